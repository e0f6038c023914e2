"""`pardsl calibrate`: measure the cost model's figures on this machine and backend, into a file.

Each collective kind is timed over `nproc` ranks at sizes from a few KiB to several MiB; α and β are a
line through (per-rank volume, seconds), with the per-rank volumes of `layouts.collective_bytes`:
Theil–Sen's (the median of the slopes between every two sizes), which one slow timing does not tip over,
as it did least squares on a busy CPU (a β of zero: bytes for free). β is at least a copy's per byte at the measured memory
bandwidth, since no collective moves bytes faster than memory does. The intercept, divided by the ring's
steps, is α per step. With every rank computing at once (CPU ranks share the
cores, as in a run), a square matmul gives the throughput, a large elementwise add the memory bandwidth
and a tiny add the overhead of one op; an all-reduce issued asynchronously beside matmuls gives the
share of communication that hides behind compute. Ranks use the threads a `pardsl run` on as many ranks
would. Every figure is a median over rounds, each of which times every probe once (`_timed_in_rounds`).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from pardsl.language.files import write_atomically
from pardsl.layouts.algebra import COLLECTIVE_KINDS, collective_bytes
from pardsl.planning.cost import LinkCost, Machine, ring_steps
from pardsl.runtime.collectives import (
    all_gather_started,
    all_reduce_started,
    collectives_by_all_to_all,
    reduce_scatter_started,
)
from pardsl.runtime.rendezvous import init_local_ranks, private_folder
from pardsl.runtime.shared_memory import shared_memory_group

SIZES = (1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22)  # bytes of one rank's tensor
QUICK_SIZES = (1 << 12, 1 << 18, 1 << 22)  # as far apart as the full set: β needs the large end


def _time(fn, device: torch.device, repeats: int, together: bool = True, warm_up: bool = True) -> float:
    if warm_up:
        fn()
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
    # as the runtime does them: on gloo, through shared memory between ranks of one host, else built on
    # gloo's all-to-all (runtime/collectives.py)
    by_all_to_all = collectives_by_all_to_all(dist.get_backend())
    shared = shared_memory_group(None)

    def waited(started):
        def run():
            work, result = started(x, n, None, by_all_to_all, shared=shared)
            work.wait()
            return result()

        return run

    if kind in ("all_reduce", "reduce_scatter"):
        return waited(all_reduce_started if kind == "all_reduce" else reduce_scatter_started)
    if kind == "all_gather":
        out = torch.empty(elements * n, device=device)
        return lambda: all_gather_started(out, x, n, None, by_all_to_all, shared=shared).wait()
    out = torch.empty_like(x)
    if shared is not None and device.type == "cpu":
        return lambda: shared.all_to_all(out, x)
    return lambda: dist.all_to_all_single(out, x)


def _timed_in_rounds(cases: dict, device: torch.device, rounds: int) -> dict[object, list[float]]:
    """Seconds per call of each case, given as key → (function, calls it makes), in each of `rounds`
    rounds. Each round times every case once, so a stretch where the machine runs slow (a shared VM's
    speed drifts over seconds) falls on all of them alike, not on one kind of collective or on compute
    alone: the search weighs them against each other. Timed one after the other, the all-to-all's latency
    came out 0.7 to 2.4 times the all-reduce's from one run to the next, and the plans it chose for the
    same model moved 2.5 to 9.4 MiB a step."""
    for function, _ in cases.values():
        function()  # warm up
    times = {key: [] for key in cases}
    for _ in range(rounds):
        for key, (function, calls) in cases.items():
            times[key].append(_time(function, device, 1, warm_up=False) / calls)  # warmed up above
    return times


def _matmuls_as_long_as(collective, matmul, device: torch.device) -> int:
    """How many matmuls take about as long as the collective, the same on every rank (the most any asks)."""
    ratio = _time(collective, device, 3) / _time(matmul, device, 3)
    count = torch.tensor([max(1, round(ratio))], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _rank(rank: int, nproc: int, folder: str, backend: str, sizes, repeats: int, result_path: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_local_ranks(backend, folder, rank, nproc, 120)
    try:
        def back_to_back(function, calls: int):
            return lambda: [function() for _ in range(calls)], calls

        # a collective ten times back to back per timing: one barrier's skew between ranks is spread over ten
        cases = {(kind, size): back_to_back(_collective(kind, size, nproc, device), 10)
                 for kind in COLLECTIVE_KINDS for size in sizes}
        # Compute is timed with every rank computing at once, as in a run: CPU ranks share the cores.
        a = torch.randn(512, 512, device=device)
        big = torch.randn(1 << 22, device=device)
        # into one buffer: a fresh 16 MiB result each time is mapped anew, and its page faults made the
        # bandwidth 4 to 15 GB/s from one run to the next
        added = torch.empty_like(big)
        tiny = torch.ones(4, device=device)
        # Overlap: an all-reduce of a gradient bucket's size, as the runtime makes it, issued asynchronously
        # while matmuls run, against the two one after the other, with as many matmuls as take about as
        # long as the all-reduce: the share hidden is a difference of timings, and against a short
        # all-reduce (1 MiB beside 8 matmuls before) a few ms of noise in the compute made it anything
        # from 0 to 100 % between runs. (Through shared memory the waiting rank moves the bytes itself,
        # so little hides, but there is little to hide.)
        all_reduce = _collective("all_reduce", 1 << 24, nproc, device)
        x = torch.ones((1 << 24) // 4 // nproc * nproc, device=device)
        shared = shared_memory_group(None)
        matmuls = _matmuls_as_long_as(all_reduce, lambda: a @ a, device)

        def compute():
            for _ in range(matmuls):
                a @ a

        def both():
            work, summed = all_reduce_started(x, nproc, None, collectives_by_all_to_all(backend), shared=shared)
            compute()
            work.wait()
            summed()

        cases.update({"matmul": back_to_back(lambda: a @ a, 8), "add": back_to_back(lambda: torch.add(big, big, out=added), 8),
                      "overhead": back_to_back(lambda: tiny + tiny, 100),
                      "comm": back_to_back(all_reduce, 1), "compute": back_to_back(compute, 1),
                      "both": back_to_back(both, 1)})
        rounds = _timed_in_rounds(cases, device, repeats)
        seconds = {key: statistics.median(timed) for key, timed in rounds.items()}
        points = {kind: [(collective_bytes(kind, size, nproc), seconds[kind, size]) for size in sizes]
                  for kind in COLLECTIVE_KINDS}
        # per round, where the three ran one after the other, then the median
        hidden = statistics.median((comm + compute - both) / min(comm, compute)
                                   for comm, compute, both in zip(rounds["comm"], rounds["compute"], rounds["both"]))
        if rank == 0:
            with open(result_path, "w") as handle:
                json.dump({"points": points, "flops_per_s": 2 * 512 ** 3 / seconds["matmul"],
                           "bytes_per_s": 3 * big.numel() * 4 / seconds["add"], "op_overhead_s": seconds["overhead"],
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

    with private_folder("pardsl-calibrate-") as folder:
        result_path = os.path.join(folder, "result.json")
        mp.start_processes(_rank, args=(nproc, folder, backend, QUICK_SIZES if quick else SIZES,
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
    data = machine.to_json()
    data["measured"] = {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "threads_per_rank": max(1, (os.cpu_count() or 1) // machine.world_size),
                        "device": torch.cuda.get_device_name(0) if machine.backend == "nccl" else "cpu",
                        "points": raw["points"]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(path, json.dumps(data, indent=2) + "\n")
