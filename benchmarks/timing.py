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


def interleaved_median_ms(steps_by_name: dict, steps: int, warmup: int = 3,
                          device: torch.device | None = None) -> dict[str, float]:
    """Median milliseconds of each named step, the steps taken in turn (one of each, `steps` times), so
    that a slow spell of the machine falls on every version alike: on this shared 2-core VM the same
    serial step measured 117 and 208 ms a minute apart, which timing one version after another turned
    into ratios that moved by a third."""
    for step in steps_by_name.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps_by_name}
    for _ in range(steps):
        for name, step in steps_by_name.items():
            times[name].append(median_step_ms(step, 1, warmup=0, device=device))
    return {name: statistics.median(values) for name, values in times.items()}
