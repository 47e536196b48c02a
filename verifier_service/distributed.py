"""Tensor parallelism: N ranks, each a process holding 1/N of every layer
(transformers' DistributedConfig(tp_size=N): the model's own TP plan). Rank 0 serves gRPC, schedules and samples;
it broadcasts each StepPlan and the other ranks run it in lockstep.

We create the process group ourselves before transformers loads the model,
because transformers does not map Ascend to `hccl`. Plans travel over a gloo
group, so they never need a device tensor.
"""

import datetime
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_TIMEOUT = datetime.timedelta(hours=1)


def backend_for(device: str) -> str:
    """The collective backend of a device kind: gloo, nccl or hccl."""
    return BACKENDS[device.split(":", 1)[0]]


def rank_device(device: str, local_rank: int) -> str:
    """Each rank's device: the CPU, or accelerator number `local_rank`."""
    kind = device.split(":", 1)[0]
    return "cpu" if kind == "cpu" else f"{kind}:{local_rank}"


def check_shardable(text_config, tp_size: int) -> None:
    """Raises ValueError unless attention heads, KV heads and the MLP split over tp_size ranks."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    for name, count in (("attention heads", heads), ("key/value heads", kv_heads),
                        ("MLP width", text_config.intermediate_size)):
        if count % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} does not divide the model's {count} {name}")


@dataclass
class TensorParallel:
    rank: int
    world_size: int
    control: object = None  # the gloo group plans travel on

    def broadcast(self, plan) -> None:
        dist.broadcast_object_list([plan], src=0, group=self.control)

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def init_tensor_parallel(device: str, rank: int, world_size: int, port: int) -> TensorParallel:
    """Joins the process group (every rank calls this with the same port)."""
    # transformers reads these when it shards the model.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = backend_for(device)
    if backend != "gloo":
        getattr(torch, device.split(":", 1)[0]).set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=_TIMEOUT)
    control = None if backend == "gloo" else dist.new_group(backend="gloo")
    return TensorParallel(rank, world_size, control)


def exit_with_parent(poll_seconds: float = 1.0) -> None:
    """A follower must not outlive rank 0 (it would wait in a broadcast forever)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
