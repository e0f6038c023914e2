"""The runtime's reduce-scatter against the backend's own, per size, on N local ranks (issue 9).

On gloo, `dist.reduce_scatter_single` all-reduces the whole input and copies this rank's chunk out; the
runtime's reduce-scatter there is an all-to-all and a local sum (pardsl/runtime.py). This times both,
and for scale an all-reduce of the same input, the same all-reduce as two all-to-alls (a reduce-scatter
and an all-gather, each one exchange: not used, see benchmarks/README.md), and an all-gather: per size,
the median of `--repeats` timings of ten back-to-back calls, the ranks started together.

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

SIZES = (1 << 15, 1 << 17, 1 << 19, 1 << 20, 1 << 22)  # bytes of each rank's input


def _rank(rank: int, nproc: int, port: int, backend: str, repeats: int) -> None:
    from pardsl.runtime import reduce_scatter_started, reduces_by_all_to_all

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=120))
    try:
        by_all_to_all = reduces_by_all_to_all(backend)
        if rank == 0:
            how = "an all-to-all and a sum" if by_all_to_all else "the backend's own"
            print(f"{nproc} ranks, {backend}; the runtime's reduce-scatter: {how}")
            print("| input per rank | backend's reduce-scatter | runtime's | all-reduce | all-reduce as two "
                  "all-to-alls | all-gather |")
            print("|---|---|---|---|---|---|")
        for size in SIZES:
            elements = size // 4 // nproc * nproc
            x = torch.ones(elements, device=device)

            def own():
                dist.reduce_scatter_single(torch.empty(elements // nproc, device=device), x)

            def runtimes():
                work, summed = reduce_scatter_started(x, nproc, None, by_all_to_all)
                work.wait()
                summed()

            def all_reduce():
                dist.all_reduce(x.clone())

            def all_reduce_by_all_to_alls():
                received = torch.empty_like(x)
                dist.all_to_all_single(received, x)
                summed = received.view(nproc, -1).sum(0)
                dist.all_to_all_single(torch.empty_like(x), summed.repeat(nproc))

            def all_gather():
                dist.all_gather_single(torch.empty(elements * nproc, device=device), x)

            row = []
            for call in (own, runtimes, all_reduce, all_reduce_by_all_to_alls, all_gather):
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

    from pardsl.pool import free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args()
    mp.start_processes(_rank, args=(args.nproc, free_port(), args.backend, args.repeats),
                       nprocs=args.nproc, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
