"""What the benchmarks share: the median time of a step on every rank, the ranks started together."""

import statistics
import time

import torch
import torch.distributed as dist


def median_step_ms(step, steps: int, warmup: int = 3, device: torch.device | None = None) -> float:
    """Median milliseconds of `step()` over `steps` runs after `warmup`, each begun after a barrier.

    On a CUDA `device` each step is timed to the end of its kernels (a synchronize before and after),
    since the launches return before the work is done."""
    def finish() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        finish()
        dist.barrier()
        start = time.perf_counter()
        step()
        finish()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)
