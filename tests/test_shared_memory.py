"""Collectives through shared memory between ranks of one host (pardsl/runtime/shared_memory.py): equal to
gloo's own (bit for bit on two ranks), with nothing through gloo, in any order of waits, and a wait on a
rank that has ended fails instead of hanging; datagrams from any other process, or out of range, are
dropped and counted, never believed."""

import collections
import contextlib
import hashlib
import itertools
import multiprocessing
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from pardsl.layouts.algebra import Mesh


class CopiesIntoBuffers(TorchDispatchMode):
    """While on: the size of each copy made into one of `group`'s buffers (a collective's start copying
    its input to where the peers read it)."""

    def __init__(self, group):
        super().__init__()
        self.group, self.numels = group, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            start = args[0].data_ptr()
            if any(b.memory.data_ptr() <= start < b.memory.data_ptr() + b.memory.numel()
                   for b in self.group._buffers):
                self.numels.append(args[0].numel())
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class AgainstGloo:
    """Run on every rank: each collective of the runtime (shared memory) against gloo's own on the same
    inputs, many started before any is waited on and waited on in reverse; which of gloo's collectives ran."""

    ranks: int

    def __call__(self) -> dict:
        import torch.distributed as dist

        from pardsl.runtime.core import Runtime

        rt = Runtime(Mesh(("dp",), (self.ranks,)))
        n, rank = self.ranks, dist.get_rank()
        used = []
        originals = {name: getattr(dist, name) for name in
                     ("all_reduce", "all_gather_single", "all_to_all_single", "reduce_scatter_single")}
        cases = list(itertools.product((6 * n, 300_000 * n), (torch.float32, torch.float64, torch.bfloat16)))
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(rank * 100 + i)).to(dtype)
                  for i, (numel, dtype) in enumerate(cases)]
        try:
            for name in originals:
                setattr(dist, name, lambda *a, _name=name, **k: used.append(_name) or originals[_name](*a, **k))
            started = []
            for x in inputs:
                started.append(("all_reduce", rt.all_reduce_started(x.clone(), "dp")))
                out = torch.empty(n * x.numel(), dtype=x.dtype)
                started.append(("all_gather", (rt.all_gather_started(out, x, "dp"), lambda out=out: out)))
                started.append(("reduce_scatter", rt.reduce_scatter_started(x.clone(), "dp")))
            got = []
            for kind, (work, result) in reversed(started):
                work.wait()
                got.append(result().clone())
            got.reverse()
            exchanged = [rt._all_to_all(x.view(n, -1), "dp", 0, 0, "forward") for x in inputs]
            through_shared_memory = list(used)
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
        errors = []
        for i, x in enumerate(inputs):
            summed = x.clone()
            dist.all_reduce(summed)
            gathered = torch.empty(n * x.numel(), dtype=x.dtype)
            dist.all_gather_single(gathered, x)
            scattered = summed.view(n, -1)[rank]
            parts = torch.empty(n * x.numel() // n, dtype=x.dtype)
            dist.all_to_all_single(parts, x)
            for value, expected in zip(got[3 * i:3 * i + 3] + [exchanged[i]], (summed, gathered, scattered, parts)):
                expected = expected.view(value.shape).double()
                errors.append((str(x.dtype), value.dtype == x.dtype, tuple(value.shape) == tuple(expected.shape),
                               ((value.double() - expected).abs().max() / expected.abs().max()).item()))
        sums = hashlib.sha256(b"".join(got[3 * i].view(-1).view(torch.uint8).numpy().tobytes()
                                       for i in range(len(inputs)))).hexdigest()
        return {"shared": sorted(rt.shared), "gloo_used": through_shared_memory, "errors": errors, "sums": sums,
                "buffers": len(rt.shared["dp"]._buffers)}


@pytest.mark.parametrize("ranks", [2, 3])
def test_shared_memory_collectives_equal_gloos_own_with_nothing_through_gloo(pools, ranks):
    reports = pools(ranks).run_on_every_rank(AgainstGloo(ranks))
    assert len({report["sums"] for report in reports}) == 1  # every rank's sums the same, bit for bit
    for report in reports:
        assert report["shared"] == ["dp"] and report["gloo_used"] == []
        for dtype, same_dtype, same_shape, relative_error in report["errors"]:
            assert same_dtype and same_shape
            # two ranks: a sum of two is the same either way round, so gloo's ring's bit for bit; over
            # three, each rank sums in rank order (the same on every rank), the ring in its own: a few
            # roundings apart
            eps = torch.finfo(getattr(torch, dtype.removeprefix("torch."))).eps
            assert relative_error == 0 if ranks == 2 else relative_error <= 4 * eps, report["errors"]


@dataclass(frozen=True)
class BuffersAfterManySteps:
    """Run on every rank: a tensor-parallel step's pattern, an all-reduce started and waited on at once,
    200 times at two sizes, with one rank slower: how many new buffers it took."""

    def __call__(self) -> tuple[int, float]:
        import torch.distributed as dist

        from pardsl.runtime.shared_memory import shared_memory_group

        group = shared_memory_group(None)  # the pool's earlier jobs' buffers too: count the ones made here
        before = len(group._buffers)
        x, y = torch.ones(1 << 16), torch.ones(100)
        for step in range(200):
            if dist.get_rank() == step % 2:
                time.sleep(0.0005)
            work, summed = group.all_reduce_started(x if step % 3 else y, overwrite=False)
            work.wait()
            value = summed()[0].item()
        return len(group._buffers) - before, value


def test_buffers_are_reused_once_every_rank_has_read_them(pools):
    for buffers, value in pools(2).run_on_every_rank(BuffersAfterManySteps()):
        assert value == 2.0 and buffers <= 6, buffers  # a few per size while a rank runs ahead, not 200


@dataclass(frozen=True)
class IntoLentBuffers:
    """Run on every rank: buckets written straight into lent buffers (`lend`), all-reduced and
    reduce-scattered from there, 100 times with one rank slower and each sum asked to overwrite its input;
    a lent tensor dropped unsent now and then. What the starts copied, the sums, and the new buffers."""

    def __call__(self) -> dict:
        import torch.distributed as dist

        from pardsl.runtime.shared_memory import shared_memory_group

        group, rank, n = shared_memory_group(None), dist.get_rank(), dist.get_world_size()
        before = len(group._buffers)
        copies, wrong = CopiesIntoBuffers(group), []
        for step in range(100):
            if step % 7 == 3:
                group.lend((n, 1 << 14), torch.float32)  # dropped: its buffer is free again
            bucket = group.lend((n, 1 << 14), torch.float32)
            bucket.copy_(torch.arange(n * (1 << 14), dtype=torch.float32).view(n, -1) * (rank + 1) + step)
            if rank == step % n:
                time.sleep(0.0005)
            with copies:
                if step % 2:
                    work, result = group.all_reduce_started(bucket.view(-1), overwrite=True)
                else:
                    work, result = group.reduce_scatter_started(bucket.view(-1))
            work.wait()
            whole = torch.arange(n * (1 << 14), dtype=torch.float32).view(n, -1) * sum(range(1, n + 1)) + n * step
            expected = whole.view(-1) if step % 2 else whole[rank]
            wrong.append((result() - expected).abs().max().item())
        return {"copied": copies.numels, "wrong": max(wrong), "buffers": len(group._buffers) - before}


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_bucket_written_into_a_lent_buffer_is_sent_without_a_copy(pools, ranks):
    for report in pools(ranks).run_on_every_rank(IntoLentBuffers()):
        assert report["copied"] == [] and report["wrong"] == 0, report
        assert report["buffers"] <= 6, report  # buffers go back once read, or once their lent tensor is dropped


@dataclass(frozen=True)
class ColumnParallelBackward:
    """Run on every rank: Megatron's f and three linears of its input (q, k, v), `sequence_split` with SP's
    gather first; backward, with x's gradient summed by the products straight into a lent buffer. What was
    copied into the transport's buffers during backward, and x's gradient against the sum over ranks."""

    sequence_split: bool = False

    def __call__(self) -> dict:
        import torch.distributed as dist

        from pardsl.runtime.core import Runtime

        rt, rank, n = Runtime(Mesh(("tp",), (dist.get_world_size(),))), dist.get_rank(), dist.get_world_size()
        generator = torch.Generator().manual_seed(0)
        whole = torch.randn(4, 6 * n, 8, generator=generator)
        weights = [torch.randn(n * rows, 8, generator=generator) for rows in (4, 2, 2)]  # q, k, v over ranks
        grads = [torch.randn(4, 6 * n, n * rows, generator=generator) for rows in (4, 2, 2)]
        mine = [w.chunk(n)[rank].clone().requires_grad_() for w in weights]
        x = (whole.chunk(n, dim=1)[rank] if self.sequence_split else whole).clone().requires_grad_()
        outputs = rt.column_parallel_linears(x, ("tp",), *((w, None) for w in mine),
                                             gather_dim=1 if self.sequence_split else None)
        copies = CopiesIntoBuffers(rt.shared["tp"])
        with copies:
            torch.autograd.backward(outputs, [g.chunk(n, dim=-1)[rank] for g in grads])
        expected = sum(g @ w for g, w in zip(grads, weights))
        expected = expected.chunk(n, dim=1)[rank] if self.sequence_split else expected
        return {"copied": copies.numels, "error": (x.grad - expected).abs().max().item()}


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("sequence_split", [False, True])
def test_a_column_parallel_inputs_gradient_is_summed_where_its_collective_reads_it(pools, ranks, sequence_split):
    # Megatron's f backward: the linears' products summed into a lent buffer, all-reduced (or, under
    # sequence parallelism, reduce-scattered) from there: nothing copied into the transport's buffers
    for report in pools(ranks).run_on_every_rank(ColumnParallelBackward(sequence_split)):
        assert report["copied"] == [] and report["error"] < 1e-4, report


@dataclass(frozen=True)
class MadeWith:
    """Run on every rank: whether a shared-memory group is made, with each rank claiming a host of its
    own, or with PARDSL_SHARED_MEMORY=0."""

    different_hosts: bool = False
    switched_off: bool = False

    def __call__(self) -> bool:
        import torch.distributed as dist

        from pardsl.runtime import shared_memory

        identity, setting = shared_memory._host_identity, os.environ.get("PARDSL_SHARED_MEMORY")
        try:
            if self.different_hosts:
                shared_memory._host_identity = lambda: ("host", dist.get_rank())
            if self.switched_off:
                os.environ["PARDSL_SHARED_MEMORY"] = "0"
            return shared_memory._made(None) is not None
        finally:
            shared_memory._host_identity = identity
            os.environ.pop("PARDSL_SHARED_MEMORY", None)
            if setting is not None:
                os.environ["PARDSL_SHARED_MEMORY"] = setting


def test_ranks_on_different_hosts_or_with_it_switched_off_keep_to_gloo(pools):
    assert pools(2).run_on_every_rank(MadeWith()) == [True, True]
    assert pools(2).run_on_every_rank(MadeWith(different_hosts=True)) == [False, False]
    assert pools(2).run_on_every_rank(MadeWith(switched_off=True)) == [False, False]


def _waits_on_a_rank_that_ends(rank: int, port: int, results, stays_alive: bool = False) -> None:
    import datetime

    import torch.distributed as dist

    from pardsl.runtime.shared_memory import shared_memory_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3 if stays_alive else 30))
    group = shared_memory_group(None)
    if rank == 1:
        if stays_alive:  # and never starts it: rank 0 waits as long as the group's timeout, as gloo would
            time.sleep(6)
        os._exit(0)  # ends without starting the collective rank 0 waits on
    started = time.monotonic()
    try:
        work, _ = group.all_reduce_started(torch.ones(4))
        work.wait()
        results.put("returned")
    except RuntimeError as error:
        results.put((str(error), time.monotonic() - started))


@pytest.mark.parametrize("stays_alive", [False, True])
def test_a_wait_on_a_rank_that_has_ended_or_never_starts_fails_instead_of_hanging(stays_alive):
    from pardsl.runtime.devices import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_waits_on_a_rank_that_ends, args=(rank, port, results, stays_alive))
                 for port in [free_port()] for rank in range(2)]
    for process in processes:
        process.start()
    try:
        message, seconds = results.get(timeout=60)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    if stays_alive:
        assert "waited 3 s (the process group's timeout) for rank(s) [1] to start collective number 0" in message
        assert 3 <= seconds < 10
    else:
        assert "rank 1 of a shared-memory group ended" in message and seconds < 10


def _last_collective_with_a_rank_that_ends_first(rank: int, port: int, results) -> None:
    import datetime

    import torch.distributed as dist

    from pardsl.runtime.shared_memory import shared_memory_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    group = shared_memory_group(None)
    work, value = group.all_reduce_started(torch.full((4,), float(rank + 1)))
    if rank == 1:
        time.sleep(2)  # rank 0 reads, acknowledges and ends before this rank reads
    try:
        work.wait()
        results.put((rank, value().tolist()))
    except RuntimeError as error:
        results.put((rank, str(error)))


def test_the_last_collective_completes_where_the_other_rank_has_already_ended():
    """A rank that finishes its last collective first ends, its socket with it: the other rank's
    acknowledgement that it read the buffer has no one to go to, and needs none."""
    from pardsl.runtime.devices import free_port

    assert _on_two_ranks(_last_collective_with_a_rank_that_ends_first, free_port(), timeout=60) == \
        {0: [3.0] * 4, 1: [3.0] * 4}


@dataclass(frozen=True)
class DifferentCollectives:
    """Run on every rank: rank 0 starts an all-reduce where rank 1 starts an all-gather of as many bytes."""

    def __call__(self) -> str:
        import torch.distributed as dist

        from pardsl.runtime.shared_memory import shared_memory_group

        group = shared_memory_group(None)
        x = torch.ones(8)
        try:
            if dist.get_rank() == 0:
                group.all_reduce_started(x)[0].wait()
            else:
                group.all_gather_started(torch.empty(16), x).wait()
        except RuntimeError as error:
            return str(error)
        return "no error"


def test_ranks_that_start_different_collectives_are_told_so(pools):
    first, second = pools(2).run_on_every_rank(DifferentCollectives())
    assert "rank 1 started all_gather of 32 bytes, rank 0 all_reduce of 32 bytes" in first
    assert "rank 0 started all_reduce of 32 bytes, rank 1 all_gather of 32 bytes" in second


def _made_again_after_a_new_process_group(rank: int, ports: list[int], results) -> None:
    import datetime

    import torch.distributed as dist

    from pardsl.runtime.shared_memory import shared_memory_group

    sums = []
    for port in ports:  # the second group may be made where the first was: it must not get the first's transport
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        group = shared_memory_group(None)
        work, summed = group.all_reduce_started(torch.full((4,), float(rank + 1)))
        work.wait()
        sums.append((summed()[0].item(), group._started))
        dist.destroy_process_group()
    results.put((rank, sums))


def test_a_new_process_group_gets_a_transport_of_its_own():
    from pardsl.runtime.devices import free_port

    got = _on_two_ranks(_made_again_after_a_new_process_group, [free_port(), free_port()], timeout=60)
    assert got == {0: [(3.0, 1), (3.0, 1)], 1: [(3.0, 1), (3.0, 1)]}  # each group's first collective


def _on_two_ranks(target, *args, timeout: float) -> dict:
    """`target(rank, *args, results)` in two fresh processes: what each put in `results`, by rank."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=target, args=(rank, *args, results)) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        return dict(results.get(timeout=timeout) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


@dataclass(frozen=True)
class AlongDimsAgainstGloo:
    """Run on every rank: the runtime's all-gather and reduce-scatter along each dim of a 3-d tensor, in
    one block and in two, through shared memory (written into place, no dim moved first) against the
    same runtime on gloo's path; and what each counted."""

    ranks: int

    def __call__(self) -> list:
        import torch.distributed as dist

        from pardsl.runtime.core import Runtime

        mesh = Mesh(("tp",), (self.ranks,))
        shared, gloo = Runtime(mesh), Runtime(mesh)
        gloo.shared = {}
        results = []
        for dim, blocks in itertools.product(range(3), (1, 2)):
            shape = [3, 5, 7]
            shape[dim] = 2 * self.ranks * blocks
            x = torch.randn(shape, generator=torch.Generator().manual_seed(dist.get_rank() * 10 + dim))
            for kind in ("all_gather", "reduce_scatter"):
                shared.counter.reset()
                got = getattr(shared, f"_{kind}")(x, "tp", dim, "forward", blocks)
                expected = getattr(gloo, f"_{kind}")(x, "tp", dim, "forward", blocks)
                results.append((kind, dim, blocks, tuple(got.shape) == tuple(expected.shape), got.is_contiguous(),
                                (got - expected).abs().max().item(), dict(+shared.counter.counts["forward"])))
        return results


@pytest.mark.parametrize("ranks", [2, 3])
def test_gathers_and_reduce_scatters_along_a_dim_equal_gloos_path(pools, ranks):
    for rank in pools(ranks).run_on_every_rank(AlongDimsAgainstGloo(ranks)):
        for kind, dim, blocks, same_shape, contiguous, error, counted in rank:
            assert same_shape and contiguous and counted == {kind: 1}, (kind, dim, blocks)
            # two ranks: the same sum of two, bit for bit; three: rank order against gloo's own order
            assert error == 0 if ranks == 2 or kind == "all_gather" else error < 1e-5, (kind, dim, blocks, error)


def test_a_wait_reads_before_it_blocks_only_where_every_rank_has_a_core():
    from pardsl.runtime.shared_memory import _SPIN_S, spin_seconds

    assert spin_seconds(2, 2) == spin_seconds(4, 16) == _SPIN_S > 0
    assert spin_seconds(3, 2) == spin_seconds(4, 2) == 0.0  # a spinning rank would hold up the one it waits for


# -- attacks: datagrams from processes that are not the group's ------------------------------------------


def _attacked_rank(rank: int, port: int, ready, go, done, results) -> None:
    import datetime

    import torch.distributed as dist

    from pardsl.runtime.shared_memory import shared_memory_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    group = shared_memory_group(None)
    group.all_reduce_started(torch.ones(4))[0].wait()  # buffers made and their descriptors passed
    fds = len(os.listdir("/proc/self/fd"))
    if rank == 0:
        ready.put([address[1:].decode() for address in group._address])
    go.wait(60)
    sums = []
    for step in range(300):  # while the attackers send
        work, summed = group.all_reduce_started(torch.full((4,), float(rank + 1 + step)))
        work.wait()
        sums.append(summed().tolist())
        time.sleep(0.002)
    done.wait(60)  # the attackers have finished
    dist.barrier()
    group.all_reduce_started(torch.ones(4))[0].wait()  # whatever is still queued is read and dropped
    results.put((rank, sums, len(os.listdir("/proc/self/fd")) - fds, len(group._buffers), dict(group.dropped)))
    dist.destroy_process_group()


def _attacker_commands() -> list[list[str]]:
    """The attacker as this user from another process, and as `nobody` where this process may become it."""
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    commands = [[python]]
    if os.getuid() == 0 and shutil.which("setpriv"):
        commands.append(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python])
    return commands


@pytest.mark.parametrize("as_user", ["same-user", "nobody"])
def test_forged_datagrams_from_another_process_change_nothing_and_leak_nothing(as_user):
    from pardsl.runtime.devices import free_port

    commands = _attacker_commands()
    if as_user == "nobody" and len(commands) < 2:
        pytest.skip("needs root and setpriv to run the attacker as another user")
    attacker = commands[0 if as_user == "same-user" else 1]
    source = open(os.path.join(os.path.dirname(__file__), "scripts", "forge_datagrams.py")).read()
    context = multiprocessing.get_context("spawn")
    ready, go, done, results = context.Queue(), context.Event(), context.Event(), context.Queue()
    port = free_port()
    processes = [context.Process(target=_attacked_rank, args=(rank, port, ready, go, done, results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    try:
        names = ready.get(timeout=60)
        go.set()
        attackers = [subprocess.Popen([*attacker, "-c", source, *names], cwd="/", stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for _ in range(3)]
        sent = [subprocess.CompletedProcess(a.args, a.wait(timeout=60), *a.communicate()) for a in attackers]
        done.set()
        got = dict((rank, rest) for rank, *rest in (results.get(timeout=90) for _ in processes))
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    assert all(run.returncode == 0 for run in sent), [run.stderr for run in sent]
    for rank, (sums, fds, buffers, dropped) in got.items():
        assert sums == [[3.0 + 2 * step] * 4 for step in range(300)], rank
        assert fds <= 0 and buffers <= 4, (rank, fds, buffers)
        assert set(dropped) <= {"not from a peer's process"}
    # every datagram that reached a rank's queue (the others found it full) was dropped for its sender
    assert sum(dropped.get("not from a peer's process", 0) for *_, dropped in got.values()) \
        == sum(int(run.stdout) for run in sent) > 0


def _addresses(tag: str, ranks: int) -> list[bytes]:
    return [f"\0pardsl-{tag}-{rank}".encode() for rank in range(ranks)]


def _forge(address: bytes, message: bytes, fds=()) -> None:
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    sender.sendmsg([message], ancillary, 0, address)
    sender.close()


def _memfd(capacity: int = 4096) -> int:
    fd = os.memfd_create("test")
    os.ftruncate(fd, capacity)
    return fd


def test_a_peers_datagrams_are_believed_only_in_range_and_in_order():
    """Datagrams sent from the process the group takes for rank 1 (this one): each field out of range, a
    replay, an unmapped buffer, a pipe for a buffer, two descriptors, an ack of nothing awaited: dropped and
    counted, their descriptors closed, nothing made ready; the well-formed announcement is believed once."""
    from pardsl.runtime.shared_memory import _MESSAGE, SharedMemoryGroup

    me = os.getpid()
    fds_before = len(os.listdir("/proc/self/fd"))
    group = SharedMemoryGroup(0, _addresses(f"test{me}", 2), [me, me], timeout_s=5)
    address = group._address[0]
    good = _memfd()
    reader, writer = os.pipe()
    cases = [
        (_MESSAGE.pack(1, 1, 0, 0, 4096, 16), [good], None),  # rank 1's input to collective 0: believed
        (_MESSAGE.pack(1, 1, 0, 0, 4096, 16), [], "out of order or replayed"),
        (_MESSAGE.pack(1, 1, 5, 0, 4096, 16), [], "out of order or replayed"),
        (_MESSAGE.pack(1, 1, 1, -1, 4096, 16), [], "out of range"),
        (_MESSAGE.pack(1, 1, 1, 0, -4096, 16), [], "out of range"),
        (_MESSAGE.pack(1, 1, 1, 0, 4096, 8192), [], "out of range"),
        (_MESSAGE.pack(1, 1, 1, 0, 4096, 16), [good, good], "out of range"),
        (_MESSAGE.pack(1, 1, 1, 3, 4096, 16), [], "a buffer not mapped"),
        (_MESSAGE.pack(1, 1, 1, 4, 4096, 16), [reader], "not a buffer"),
        (_MESSAGE.pack(9, 1, 1, 0, 4096, 16), [], "unknown kind"),
        (_MESSAGE.pack(1, 7, 1, 0, 4096, 16), [], "sender's rank and process disagree"),
        (_MESSAGE.pack(1, 0, 1, 0, 4096, 16), [], "sender's rank and process disagree"),
        (_MESSAGE.pack(0, 1, 0, -1, 0, 0), [], "an ack of nothing awaited"),
        (_MESSAGE.pack(0, 1, 0, 0, 0, 0), [], "an ack of nothing awaited"),
        (b"abc", [], "malformed"),
        (_MESSAGE.pack(1, 1, 1, 0, 4096, 16) + b"!", [], "malformed"),
    ]
    expected = collections.Counter()
    for message, fds, reason in cases:
        _forge(address, message, fds)
        group._receive(block=False)
        if reason:
            expected[reason] += 1
        assert group.dropped == expected, (message, reason)
    assert group._ready == {0: {1: (0, 16, "all_reduce")}}
    for fd in (good, reader, writer):
        os.close(fd)
    group._socket.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before  # every descriptor received was closed


def test_a_send_to_a_full_queue_gives_up_at_the_deadline():
    """A peer that is alive but never reads: its queue fills, and the sender fails at the group's timeout
    instead of retrying for ever."""
    from pardsl.runtime.shared_memory import SharedMemoryGroup

    me = os.getpid()
    group = SharedMemoryGroup(0, _addresses(f"full{me}", 2), [me, me], timeout_s=1.5)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stuck.bind(group._address[1])  # rank 1's socket, never read
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="could not send to rank 1 for 2 s"):
        for number in range(100_000):
            group._send(1, 0, number, 0)
    assert time.monotonic() - started < 10
    stuck.close()
    group._socket.close()


def test_a_dead_peer_is_noticed_within_seconds_while_datagrams_keep_arriving():
    """Rank 1's process has ended; forged datagrams keep arriving all the while: the wait still looks its
    peers up every second and fails naming rank 1, long before the group's timeout."""
    import threading

    from pardsl.runtime.shared_memory import _MESSAGE, SharedMemoryGroup

    ended = subprocess.Popen(["true"])
    ended.wait()
    me = os.getpid()
    group = SharedMemoryGroup(0, _addresses(f"dead{me}", 2), [me, ended.pid], timeout_s=60)
    flooding = threading.Event()

    def flood():
        while not flooding.is_set():
            with contextlib.suppress(OSError):
                _forge(group._address[0], _MESSAGE.pack(1, 1, 0, 0, 4096, 16))
            time.sleep(0.001)

    flooder = threading.Thread(target=flood)
    flooder.start()
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=f"rank 1 of a shared-memory group ended \\(process {ended.pid}\\)"):
            group._send = lambda *args, **kwargs: None  # rank 1's socket is gone with it: only the wait is tried
            group.all_reduce_started(torch.ones(4))[0].wait()
    finally:
        flooding.set()
        flooder.join()
        group._socket.close()
    assert time.monotonic() - started < 5
    assert group.dropped["sender's rank and process disagree"] > 10


# -- attacks: names taken before a rank binds its own ----------------------------------------------------

_NAME_SQUATTER = r"""
import socket, sys, time
# Another user: whatever shared-memory socket name appears in /proc/net/unix, bind the names its siblings
# would have (the same name with another rank's number) before the other ranks can.
taken, seen, deadline = [], set(), time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    with open("/proc/net/unix") as table:
        names = {line.split()[-1][1:] for line in table if "@pardsl-" in line}
    for name in names - seen:
        seen.add(name)
        stem = name.rsplit("-", 1)[0]
        for candidate in [name] + [f"{stem}-{rank}" for rank in range(4)]:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                s.bind("\0" + candidate)
                taken.append(s)
            except OSError:
                pass
print(len(seen))
"""


def _groups_formed_under_attack(rank: int, folder: str, tries: int, results) -> None:
    import torch.distributed as dist

    from pardsl.runtime.rendezvous import init_local_ranks
    from pardsl.runtime.shared_memory import shared_memory_group

    init_local_ranks("gloo", folder, rank, 2, 30)
    formed = []
    for _ in range(tries):
        try:
            group = shared_memory_group(dist.new_group([0, 1]))
            work, summed = group.all_reduce_started(torch.ones(4))
            work.wait()
            formed.append(summed().tolist() == [2.0] * 4)
        except Exception as error:  # the start-up the squatter stopped
            formed.append(repr(error))
            break
    results.put((rank, formed))
    dist.destroy_process_group()


@pytest.mark.parametrize("as_user", ["same-user", "nobody"])
def test_a_name_bound_first_by_another_process_cannot_stop_start_up(as_user, tmp_path):
    commands = _attacker_commands()
    if as_user == "nobody" and len(commands) < 2:
        pytest.skip("needs root and setpriv to run the attacker as another user")
    squatter = subprocess.Popen([*commands[0 if as_user == "same-user" else 1], "-c", _NAME_SQUATTER, "30"],
                                cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tries = 12
    try:
        got = _on_two_ranks(_groups_formed_under_attack, str(tmp_path), tries, timeout=120)
    finally:
        squatter.kill()
        out, err = squatter.communicate()
    assert got == {0: [True] * tries, 1: [True] * tries}, got
    assert not err
