"""Long-lived gloo ranks for running many compiled programs quickly (the test suite, benchmarks).

`pardsl run` starts fresh processes for every run; that costs seconds. A `WorkerPool` starts its processes
and their process group once and then runs `execution.run_rank` for each job it is given, on every rank,
returning the combined report. Every job has a timeout: a hang fails the job and closes the pool instead
of blocking. The ranks meet in a private folder's FileStore (pardsl/runtime/rendezvous.py), not on a port
another user could reach.
"""

from __future__ import annotations

import os
import queue
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pardsl.runtime.rendezvous import init_local_ranks, private_folder
from pardsl.tools.execution import RankJob, combine, run_rank


def _worker(rank: int, world_size: int, folder: str, tasks, results, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    init_local_ranks("gloo", folder, rank, world_size, timeout_s)
    try:
        while True:
            job = tasks.get()
            if job is None:
                break
            try:
                # A RankJob runs the compiled-vs-serial check; any other job is a callable run on every rank.
                results.put((rank, "ok", run_rank(job) if isinstance(job, RankJob) else job()))
            except BaseException:  # reported to the caller, who fails the test with it
                results.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    # End without the interpreter's finalization, which took seconds per worker (torch's and gloo's
    # objects torn down one by one) and kept the closing pool waiting; what it sent is flushed first.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class PoolError(RuntimeError):
    pass


class WorkerPool:
    def __init__(self, world_size: int, timeout_s: float = 60.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        context = mp.get_context("spawn")
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._results = context.Queue()
        self._folder = private_folder("pardsl-pool-")
        folder = self._folder.__enter__()
        self._processes = []
        try:
            for rank in range(world_size):
                process = context.Process(
                    target=_worker, args=(rank, world_size, folder, self._tasks[rank], self._results, timeout_s),
                    daemon=True, name=f"pardsl-rank{rank}")
                process.start()
                self._processes.append(process)
        except BaseException:  # the workers started wait on the store for ever: end them, remove the folder
            self.close()
            raise
        self.broken = False

    def run(self, job: RankJob) -> dict:
        """Run a RankJob on every rank; its combined report."""
        if job.mesh.size != self.world_size:
            raise ValueError(f"a {job.mesh.size}-rank job on a {self.world_size}-rank pool")
        reports = self.run_on_every_rank(job)
        return combine(reports, job)

    def run_on_every_rank(self, job) -> list:
        """Run a job (a RankJob or a picklable callable) on every rank; the ranks' results in rank order."""
        if self.broken:
            raise PoolError("the pool was closed after an earlier failure")
        for tasks in self._tasks:
            tasks.put(job)
        reports, errors = {}, {}
        try:
            while len(reports) + len(errors) < self.world_size:
                rank, status, payload = self._results.get(timeout=self.timeout_s * 2 + 30)
                (reports if status == "ok" else errors)[rank] = payload
        except queue.Empty:
            self.close()
            raise PoolError(f"ranks did not answer within {self.timeout_s * 2 + 30:.0f} s; pool closed") from None
        if errors:
            if len(errors) < self.world_size or any(p.exitcode is not None for p in self._processes):
                self.close()  # ranks may be out of step with each other now
            rank = min(errors)
            raise PoolError(f"rank {rank} failed:\n{errors[rank]}")
        return [reports[r] for r in sorted(reports)]

    def close(self) -> None:
        self.broken = True
        for tasks in self._tasks:
            try:
                tasks.put(None)
            except (ValueError, OSError):
                pass
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
        if self._folder is not None:
            self._folder.__exit__(None, None, None)
            self._folder = None
