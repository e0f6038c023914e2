"""`pardsl calibrate`: measure the cost model's figures on this machine and backend, into a file.

Each collective kind is timed over `nproc` ranks at sizes from a few KiB to several MiB; α and β are a
line through (per-rank volume, seconds), with the volumes of DESIGN's table: Theil–Sen's (the median of
the slopes between every two sizes), which one slow timing does not tip over, as it did least squares on
a busy CPU (a β of zero: bytes for free). β is at least a copy's per byte at the measured memory
bandwidth, since no collective moves bytes faster than memory does. The intercept, divided by the ring's
steps, is α per step. With every rank computing at once (CPU ranks share the
cores, as in a run), a square matmul gives the throughput, a large elementwise add the memory bandwidth
and a tiny add the overhead of one op; an all-reduce issued asynchronously beside matmuls gives the
share of communication that hides behind compute. Ranks use the threads a `pardsl run` on as many ranks
would.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from .cost import LinkCost, Machine, ring_steps
from .layouts import COLLECTIVE_KINDS, collective_bytes
from .runtime import all_gather_started, all_reduce_started, collectives_by_all_to_all, reduce_scatter_started

SIZES = (1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22)  # bytes of one rank's tensor
QUICK_SIZES = (1 << 12, 1 << 18, 1 << 22)  # as far apart as the full set: β needs the large end


def _time(fn, device: torch.device, repeats: int, together: bool = True) -> float:
    fn()  # warm up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        if together:  # every rank starts the collective at once
            dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective(kind: str, local_bytes: int, n: int, device: torch.device):
    elements = max(n, local_bytes // 4 // n * n)  # divisible by n for the splitting collectives
    x = torch.ones(elements, device=device)
    # as the runtime does them: on gloo, built on its all-to-all (runtime.collectives_by_all_to_all)
    by_all_to_all = collectives_by_all_to_all(dist.get_backend())
    if kind == "all_reduce":
        def all_reduce():
            work, summed = all_reduce_started(x, n, None, by_all_to_all)
            work.wait()
            return summed()

        return all_reduce
    if kind == "all_gather":
        out = torch.empty(elements * n, device=device)
        return lambda: all_gather_started(out, x, n, None, by_all_to_all).wait()
    if kind == "reduce_scatter":
        def reduce_scatter():
            work, summed = reduce_scatter_started(x, n, None, by_all_to_all)
            work.wait()
            return summed()

        return reduce_scatter
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x)


def _rank(rank: int, nproc: int, port: int, backend: str, sizes, repeats: int, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=120))
    try:
        points = {kind: [] for kind in COLLECTIVE_KINDS}
        for kind in COLLECTIVE_KINDS:
            for size in sizes:
                one = _collective(kind, size, nproc, device)
                # ten back to back per timing: one barrier's skew between ranks is spread over ten
                seconds = _time(lambda: [one() for _ in range(10)], device, repeats) / 10
                points[kind].append((collective_bytes(kind, size, nproc), seconds))
        # Compute is timed with every rank computing at once, as in a run: CPU ranks share the cores.
        a = torch.randn(512, 512, device=device)
        matmul_s = _time(lambda: a @ a, device, repeats)
        big = torch.randn(1 << 22, device=device)
        add_s = _time(lambda: big + big, device, repeats)
        tiny = torch.ones(4, device=device)
        overhead_s = _time(lambda: [tiny + tiny for _ in range(100)], device, repeats) / 100
        # Overlap: an all-reduce issued asynchronously while matmuls run, against the two one after the other.
        x = torch.ones(1 << 20, device=device)

        def compute():
            for _ in range(8):
                a @ a

        def both():
            handle = dist.all_reduce(x, async_op=True)
            compute()
            handle.wait()

        comm_s = _time(lambda: dist.all_reduce(x), device, repeats)
        compute_s = _time(compute, device, repeats)
        both_s = _time(both, device, repeats)
        hidden = (comm_s + compute_s - both_s) / min(comm_s, compute_s)
        if rank == 0:
            with open(result_path, "w") as handle:
                json.dump({"points": points, "flops_per_s": 2 * 512 ** 3 / matmul_s,
                           "bytes_per_s": 3 * big.numel() * 4 / add_s, "op_overhead_s": overhead_s,
                           "overlap": min(1.0, max(0.0, hidden))}, handle)
    finally:
        dist.destroy_process_group()


def fit(points: list[tuple[int, float]], beta_floor: float = 0.0) -> LinkCost:
    """α and β of the Theil–Sen line through (bytes, seconds): β the median of the slopes between every
    two points, at least `beta_floor`; α the median intercept at that β, at least zero."""
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(sorted(points), 2) if x2 != x1]
    beta = max(statistics.median(slopes) if slopes else 0.0, beta_floor, 1e-15)
    alpha = max(statistics.median(y - beta * x for x, y in points), 0.0)
    return LinkCost(alpha, beta)


def calibrate(nproc: int = 2, backend: str = "gloo", quick: bool = False, repeats: int = 5) -> tuple[Machine, dict]:
    """Measure on `nproc` local ranks; returns the machine and the raw points."""
    import torch.multiprocessing as mp

    from .pool import free_port

    with tempfile.TemporaryDirectory(prefix="pardsl-calibrate-") as folder:
        result_path = os.path.join(folder, "result.json")
        mp.start_processes(_rank, args=(nproc, free_port(), backend, QUICK_SIZES if quick else SIZES,
                                        3 if quick else repeats, result_path),
                           nprocs=nproc, join=True, start_method="spawn")
        with open(result_path) as handle:
            raw = json.load(handle)
    collectives = {}
    for kind, points in raw["points"].items():
        line = fit(points, 1.0 / raw["bytes_per_s"])  # its intercept: the latency of ring_steps steps
        collectives[kind] = LinkCost(line.alpha_s / ring_steps(kind, nproc), line.beta_s_per_byte)
    machine = Machine(backend, collectives, raw["flops_per_s"], raw["bytes_per_s"], raw["op_overhead_s"],
                      "calibrated", nproc, 0 if backend == "nccl" else (os.cpu_count() or 1), raw["overlap"])
    return machine, raw


def write(machine: Machine, raw: dict, path: str) -> None:
    from .compiler import write_atomically  # not at import: the ranks import this module, not the compiler

    data = machine.to_json()
    data["measured"] = {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "threads_per_rank": max(1, (os.cpu_count() or 1) // machine.world_size),
                        "device": torch.cuda.get_device_name(0) if machine.backend == "nccl" else "cpu",
                        "points": raw["points"]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(path, json.dumps(data, indent=2) + "\n")
