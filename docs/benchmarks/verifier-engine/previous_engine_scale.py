"""The previous engine's decode scale (per-sequence KV tensors, attention looped over the sequences),
for rows beside `speclane bench verifier`'s scale section. Run it from a checkout of commit fdef18b with
that checkout's venv: `python docs/benchmarks/verifier-engine/previous_engine_scale.py MODEL_DIR`."""

import json
import sys
import time

import torch

from verifier_service.engine import Engine
from verifier_service.kv_pool import KVPool
from verifier_service.model_runner import ModelRunner
from verifier_service.scheduler import BatchLimits
from verifier_service.sequence import Draft, GenerationParams


def scale(model_dir: str, sizes: list[int], steps: int = 4) -> list[dict]:
    torch.set_num_threads(2)  # what the current engine takes on this 2-core host
    runner = ModelRunner(model_dir, "cpu", torch.float32, block_size=16)
    rows = []
    for size in sizes:
        engine = Engine(runner, KVPool(size * 128, 16, False),
                        BatchLimits(max_tokens=4096, max_sequences=size, max_queue_wait=3600))
        params = GenerationParams(max_new_tokens=steps + 2, ignore_eos=True)
        seqs = [engine.open(f"s{i}", [(i * 97 + j * 13) % 40000 + 100 for j in range(32)], params)
                for i in range(size)]
        engine.run_together([(seq, Draft()) for seq in seqs])
        engine.run_together([(seq, Draft()) for seq in seqs])  # a first decode pass: warm
        started = time.perf_counter()
        for _ in range(steps):
            engine.run_together([(seq, Draft()) for seq in seqs])
        seconds = time.perf_counter() - started
        rows.append({"sequences": size, "tokens_per_s": round(size * steps / seconds, 1),
                     "pass_ms": round(seconds / steps * 1e3, 1)})
        for seq in seqs:
            engine.close(seq)
        engine.step()
    return rows


if __name__ == "__main__":
    print(json.dumps({"previous_engine_scale": scale(sys.argv[1], [32, 64, 128])}))
