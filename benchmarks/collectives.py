"""The runtime's collectives against the backend's own, per size, on N local ranks (issue 9).

On gloo the runtime builds some collectives on gloo's all-to-all (pardsl/runtime.py,
`collectives_by_all_to_all`): a reduce-scatter is an all-to-all and a local sum (gloo's own all-reduces
the whole input); over two ranks, an all-gather and an all-reduce, of any size, are one exchange in which
each rank sends the other its tensor (gloo's all-reduce ring takes two dependent steps); over more, an
all-gather of up to `EXCHANGE_MAX_BYTES` per rank is one all-to-all of n copies of the input (gloo's own
is a ring of n − 1 steps). This times each pair:
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
    from pardsl.runtime import all_gather_started, all_reduce_started, collectives_by_all_to_all, reduce_scatter_started

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=120))
    try:
        ours = collectives_by_all_to_all(backend)
        if rank == 0:
            how = "built on the all-to-all" if ours else "the backend's own"
            print(f"{nproc} ranks, {backend}; the runtime's collectives: {how}")
            print("| input per rank | backend's reduce-scatter | runtime's | backend's all-reduce | runtime's | "
                  "backend's all-gather | runtime's |")
            print("|---|---|---|---|---|---|---|")
        for size in SIZES:
            elements = size // 4 // nproc * nproc
            x = torch.ones(elements, device=device)
            gathered = torch.empty(elements * nproc, device=device)

            def reduce_scatter(by_all_to_all):
                work, summed = reduce_scatter_started(x, nproc, None, by_all_to_all)
                work.wait()
                summed()

            def all_reduce(by_all_to_all):
                work, summed = all_reduce_started(x.clone(), nproc, None, by_all_to_all)
                work.wait()
                summed()

            def all_gather(by_all_to_all):
                all_gather_started(gathered, x, nproc, None, by_all_to_all).wait()

            calls = [lambda c=c, b=b: c(b) for c in (reduce_scatter, all_reduce, all_gather) for b in (False, ours)]
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
