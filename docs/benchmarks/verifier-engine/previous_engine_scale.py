"""The previous engine's decode scale and host overhead (run from the pre-paged-cache tree), for side-by-side rows."""
import json, statistics, sys, tempfile, time
import torch
from verifier_service.engine import Engine
from verifier_service.kv_pool import KVPool
from verifier_service.model_runner import ModelRunner
from verifier_service.scheduler import BatchLimits
from verifier_service.sequence import Draft, GenerationParams
from verifier_service.batch import Segment, StepPlan

def scale(model_dir, sizes, steps=4):
    torch.set_num_threads(2)
    runner = ModelRunner(model_dir, "cpu", torch.float32, block_size=16)
    rows = []
    for size in sizes:
        engine = Engine(runner, KVPool(size * 128, 16, False), BatchLimits(max_tokens=4096, max_sequences=size, max_queue_wait=3600))
        params = GenerationParams(max_new_tokens=steps + 2, ignore_eos=True)
        seqs = [engine.open(f"s{i}", [(i * 97 + j * 13) % 40000 + 100 for j in range(32)], params) for i in range(size)]
        engine.run_together([(s, Draft()) for s in seqs]); engine.run_together([(s, Draft()) for s in seqs])
        t = time.perf_counter()
        for _ in range(steps):
            engine.run_together([(s, Draft()) for s in seqs])
        sec = time.perf_counter() - t
        rows.append({"sequences": size, "tokens_per_s": round(size * steps / sec, 1), "pass_ms": round(sec / steps * 1e3, 1)})
        for s in seqs: engine.close(s)
        engine.step()
    return rows

if __name__ == "__main__":
    print(json.dumps({"previous_engine_scale": scale(sys.argv[1], [32, 64, 128])}))
