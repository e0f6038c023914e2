"""Which backend and device a run uses: NCCL and CUDA where a GPU is, gloo and the CPU elsewhere; each
rank's GPU; and a free local port for ranks to meet on. Read by the compiler's default machine, the checked run and the API alike."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def resolve_device(device: str | None, backend: str) -> str:
    """"cpu" or "cuda": as asked, else (None, "auto") CUDA under NCCL, which moves CUDA tensors only."""
    if device in (None, "auto"):
        return "cuda" if backend == "nccl" else "cpu"
    return device


def rank_device(kind: str) -> torch.device:
    """This rank's device of that kind: GPU `local rank % GPUs` (made current), or the CPU."""
    if kind != "cuda":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
