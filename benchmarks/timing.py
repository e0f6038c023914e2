"""What the benchmarks share: the median time of a step on every rank, the ranks started together."""

import queue
import socket
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


def on_two_ranks(worker, *args):
    """`worker(rank, port, *args, results)` on two spawned processes; what rank 0 puts in `results`."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.get_context("spawn").Queue()
    ranks = mp.start_processes(worker, args=(port, *args, results), nprocs=2, start_method="spawn", join=False)
    while True:  # read before the join: rank 0 exits only once what it put is read
        try:
            measured = results.get(timeout=5)
            break
        except queue.Empty:
            ranks.join(timeout=0)  # raises a rank's error, where one failed
    while not ranks.join():
        pass
    return measured


def training_step_ms(model, inputs: dict) -> tuple[float, list]:
    """One step of `model` on `inputs` begun after a barrier: forward, a mean-square loss's backward, the
    gradients zeroed. Its milliseconds, and the output and gradients it made (to compare ways)."""
    dist.barrier()
    start = time.perf_counter()
    out = model(**inputs)
    out = out if isinstance(out, torch.Tensor) else out[0]
    out.float().square().mean().backward()
    made = [out.detach()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) * 1000, made
