"""The runtime's collectives against the backend's own, per size, on N local ranks.

On gloo, between ranks of one host, the runtime's collectives go through shared memory
(pardsl/runtime/shared_memory.py); between hosts it builds some on gloo's all-to-all (pardsl/runtime/core.py,
`collectives_by_all_to_all`): a reduce-scatter is an all-to-all and a local sum (gloo's own all-reduces
the whole input); over two ranks, an all-gather and an all-reduce, of any size, are one exchange in which
each rank sends the other its tensor (gloo's all-reduce ring takes two dependent steps); over more, an
all-gather of up to `EXCHANGE_MAX_BYTES` per rank is one all-to-all of n copies of the input (gloo's own
is a ring of n − 1 steps). This times the three ways of each (on NCCL, the backend's own alone):
per size, the median of `--repeats` timings of ten back-to-back calls, the ranks started together.

    python benchmarks/collectives.py [--nproc 2] [--repeats 7] [--backend gloo]
"""

import argparse
import datetime
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SIZES = (1 << 15, 1 << 17, 1 << 19, 1 << 20, 1 << 22, 1 << 24)  # bytes of each rank's input (a bucket: up to 25 MiB)


def _rank(rank: int, nproc: int, port: int, backend: str, repeats: int) -> None:
    from pardsl.runtime.collectives import all_gather_started, all_reduce_started, collectives_by_all_to_all, reduce_scatter_started
    from pardsl.runtime.shared_memory import shared_memory_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=120))
    try:
        # (by_all_to_all, shared): the backend's own, built on its all-to-all, through shared memory
        ways = {"own": (False, None)}
        if collectives_by_all_to_all(backend):
            ways["all-to-all"] = (True, None)
        shared = shared_memory_group(None)
        if shared is not None:
            ways["shared memory"] = (True, shared)
        kinds = ("reduce-scatter", "all-reduce", "all-gather")
        if rank == 0:
            print(f"{nproc} ranks, {backend}")
            print("| input per rank | " + " | ".join(f"{kind}: {way}" for kind in kinds for way in ways) + " |")
            print("|---|" + "---|" * (len(kinds) * len(ways)))
        for size in SIZES:
            elements = size // 4 // nproc * nproc
            x = torch.ones(elements, device=device)
            gathered = torch.empty(elements * nproc, device=device)

            def reduce_scatter(how):
                work, summed = reduce_scatter_started(x, nproc, None, how[0], shared=how[1])
                work.wait()
                summed()

            def all_reduce(how):
                work, summed = all_reduce_started(x.clone(), nproc, None, how[0], shared=how[1])
                work.wait()
                summed()

            def all_gather(how):
                all_gather_started(gathered, x, nproc, None, how[0], shared=how[1]).wait()

            calls = [lambda c=c, how=how: c(how) for c in (reduce_scatter, all_reduce, all_gather) for how in ways.values()]
            row = []
            for call in calls:
                call()
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(10):
                        call()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append((time.perf_counter() - start) / 10)
                row.append(statistics.median(times) * 1e3)
            if rank == 0:
                print(f"| {size // 1024} KiB | " + " | ".join(f"{ms:.2f} ms" for ms in row) + " |", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from pardsl.runtime.devices import free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args()
    mp.start_processes(_rank, args=(args.nproc, free_port(), args.backend, args.repeats),
                       nprocs=args.nproc, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
