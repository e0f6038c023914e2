"""What the benchmarks share: the median time of a step on every rank, the ranks started together."""

import statistics
import time

import torch.distributed as dist


def median_step_ms(step, steps: int, warmup: int = 3) -> float:
    """Median milliseconds of `step()` over `steps` runs after `warmup`, each begun after a barrier."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)
