"""Collectives started now and waited on later, over one process group: through the shared-memory
transport where the group's ranks share a host, as one all-to-all of copies where that beats gloo's own
(small tensors over more than two ranks), else torch.distributed's."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from pardsl.layouts.algebra import Mesh

_MESH_CACHE: dict[tuple, object] = {}  # per mesh shape, device type and default group


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def device_mesh(mesh: Mesh, device_type: str):
    """One DeviceMesh per mesh shape and process (creating groups is collective; reuse them)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (mesh.axis_names, mesh.axis_sizes, device_type, id(dist.distributed_c10d._get_default_group()))
    if key not in _MESH_CACHE:
        _MESH_CACHE[key] = init_device_mesh(device_type, mesh.axis_sizes, mesh_dim_names=mesh.axis_names)
    return _MESH_CACHE[key]


def all_gather_json(value, group=None) -> list:
    """Every rank's `value` (JSON data: dicts, lists, strings, numbers, booleans, None; tuples come back as
    lists), in rank order. torch's all_gather_object unpickles what peers send, and a pickle is code: what
    arrives here is parsed as JSON, never run, whoever managed to send it."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    mine = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(length.item()) for length in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [json.loads(data[:int(length.item())].cpu().numpy().tobytes()) for data, length in zip(gathered, lengths)]


def collectives_by_all_to_all(backend: str) -> bool:
    """Whether this backend's reduce-scatters, all-gathers (over more than two ranks, small ones) and
    all-reduces over two ranks are built on its all-to-all (reduce_scatter_started, all_gather_started,
    all_reduce_started): gloo's own are slower (`python benchmarks/collectives.py`)."""
    return backend == "gloo"


# The largest tensor (bytes per rank) all-gathered over more than two ranks by an all-to-all: above it the n
# copies it sends cost more than the exchange saves, and gloo's own is as fast (benchmarks/collectives.py)
EXCHANGE_MAX_BYTES = 1 << 20


def _exchange_started(received: torch.Tensor, sent: torch.Tensor, group):
    """Over a group of two ranks: send `sent` (contiguous, flat) to the other rank and nothing to this one,
    receiving the other's into `received`, as one all-to-all (gloo's exchange without a send buffer): the
    work to wait on."""
    to_each = [0, sent.numel()] if dist.get_rank(group) == 0 else [sent.numel(), 0]
    return dist.all_to_all_single(received, sent, to_each, to_each, group=group, async_op=True)


def all_reduce_started(x: torch.Tensor, n: int, group, by_all_to_all: bool, overwrite: bool = True,
                       shared=None):
    """Start summing x (contiguous) over the n ranks of `group`: (the work to wait on, a function giving the
    sum once it has finished). `overwrite`: the backend's all-reduce may sum into x itself (else into a
    copy; the exchange below never writes x).

    `by_all_to_all`: gloo's all-reduce is a ring, two dependent steps on two ranks, each a wake-up of gloo's
    threads on both. As one all-to-all, each of two ranks sends the other its whole tensor and nothing to
    itself (the ring's bytes on two ranks, from x itself: no send buffer) and adds its own into the buffer
    the other's arrived in: no tensor allocated for the sum, and x0 + x1, the ring's sum, bit for bit (a
    floating-point sum of two is the same either way round). Faster than the ring up to 4 MiB and as fast
    at 16 MiB (benchmarks/collectives.py); over more ranks it would move more bytes.

    `shared`: the group's shared-memory transport (pardsl/runtime/shared_memory.py), where its ranks share this
    host: faster than either, for CPU tensors."""
    if shared is not None and x.device.type == "cpu":
        return shared.all_reduce_started(x, overwrite)
    if by_all_to_all and n == 2:
        flat = x.view(-1)
        received = torch.empty_like(flat)
        work = _exchange_started(received, flat, group)
        return work, lambda: received.add_(flat).view(x.shape)
    if not overwrite:
        x = x.clone()
    work = dist.all_reduce(x, group=group, async_op=True)
    return work, lambda: x


def all_gather_started(out: torch.Tensor, x: torch.Tensor, n: int, group, by_all_to_all: bool, shared=None):
    """Start gathering x (contiguous) from the n ranks of `group` into `out` (n times x's size, rank r's at
    chunk r of dim 0): the work to wait on.

    `by_all_to_all`: over two ranks, each sends x itself to the other and receives the other's straight into
    its place in `out` (one exchange of the ring's bytes, no send buffer; faster than gloo's at every size
    measured, 32 KiB to 4 MiB). Over more, up to EXCHANGE_MAX_BYTES, every rank sends its x to each other
    rank in one all-to-all of n copies of it: a ring all-gather's bytes in one step instead of n − 1 (a
    sequence-parallel step on two gloo ranks here took 66 ms with gloo's own, 60 with this); the copies are
    a local write of n times x. `shared`: as all_reduce_started's."""
    if shared is not None and x.device.type == "cpu":
        return shared.all_gather_started(out, x)
    if by_all_to_all and n == 2:
        rows, flat = out.view(2, -1), x.view(-1)
        mine = dist.get_rank(group)
        work = _exchange_started(rows[1 - mine], flat, group)
        rows[mine].copy_(flat)
        return work
    if by_all_to_all and nbytes(x) <= EXCHANGE_MAX_BYTES:
        copies = x.expand(n, *x.shape).contiguous().view(out.shape)
        return dist.all_to_all_single(out, copies, group=group, async_op=True)
    return dist.all_gather_single(out, x, group=group, async_op=True)


def reduce_scatter_started(moved: torch.Tensor, n: int, group, by_all_to_all: bool, shared=None):
    """Start summing `moved` over the n ranks of `group`, each rank keeping its chunk of dim 0 (moved is
    contiguous, chunk r of dim 0 is rank r's): (the work to wait on, a function giving this rank's sum
    once it has finished).

    `by_all_to_all`: gloo's reduce-scatter all-reduces the whole input and copies this rank's chunk out,
    twice a ring reduce-scatter's bytes and as slow as an all-reduce (2 to 8 times slower than an
    all-to-all of the same input on 2 and 4 CPU ranks). An all-to-all hands every rank the n
    contributions to its chunk, the ring's per-rank volume, and the rank sums them in rank order. Over two
    ranks each sends the other only the other's chunk, and adds its own into what it received. `shared`:
    as all_reduce_started's."""
    if shared is not None and moved.device.type == "cpu":
        return shared.reduce_scatter_started(moved)
    if by_all_to_all and n == 2:
        rows = moved.view(2, -1)
        mine = dist.get_rank(group)
        received = torch.empty_like(rows[mine])
        work = _exchange_started(received, rows[1 - mine], group)
        shape = (moved.shape[0] // 2, *moved.shape[1:])
        return work, lambda: received.add_(rows[mine]).view(shape)
    if by_all_to_all:
        received = torch.empty_like(moved)
        work = dist.all_to_all_single(received, moved, group=group, async_op=True)
        return work, lambda: received.view(n, moved.shape[0] // n, *moved.shape[1:]).sum(0)
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    work = dist.reduce_scatter_single(out, moved, group=group, async_op=True)
    return work, lambda: out
