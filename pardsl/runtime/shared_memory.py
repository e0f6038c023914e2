"""Collectives between ranks on one host through shared memory: what gloo does over TCP, without the TCP.

gloo moves every byte between two processes on the same machine through the loopback's sockets: copies
into and out of the kernel and wake-ups of gloo's threads, on the same cores the ranks compute on. A
4 MiB all-reduce between two ranks took 11.8 ms there and 1.2 ms through shared memory
(`python benchmarks/collectives.py`). NCCL's SHM transport and oneCCL do the same for the ranks of one
node; this is that transport for gloo's CPU tensors.

How one collective goes, on every rank of the group, in the order the program issues them (an SPMD
program issues the same collectives in the same order on every rank, so the k-th collective of a group
is the same one everywhere; gloo relies on the same):
- start: copy this rank's input into one of its buffers (memory shared with the other ranks: a memfd,
  whose descriptor travels to each peer once, over a Unix socket), and tell every peer, with a datagram
  on that socket, which buffer holds its input for collective number k;
- wait: read the peers' datagrams until each has said where its input for k is, compute this rank's
  result from the buffers (a sum in rank order, so every rank's is the same bit for bit; on two ranks the
  same as gloo's ring, a sum of two being the same either way round), and tell each peer its buffer has
  been read (an ack), so it can be used again.
A start never blocks (it takes a buffer whose every ack is in, or makes a new one) and a wait blocks only
on datagrams its peers send when they start the same collective, which they do before they wait on
anything after it: no collective waits on another, whatever their order. The datagram names the
collective and its bytes, so ranks whose programs issue different ones fail saying so, rather than read
each other's bytes as something else. A wait gives up as gloo's would, after the process group's
timeout, and within a second where a peer's process has ended. Nothing goes through the file system, so
nothing is left behind: the buffers go when the processes do.

Each rank binds its socket to an abstract name of 128 random bits before the names are exchanged (as
JSON, never a pickle), so no one can bind a rank's name before it does and stop the start-up. The socket
names are abstract, so any process on the host can send to them. A datagram is believed only
when the kernel's credentials on it (`SO_PASSCRED`) say it comes from a peer's own process (the pid the
group exchanged for that rank, and this process's uid), it has exactly the message's size, and every field
is in range: the sender's rank agrees with its pid, the collective number is the next one expected from that
peer (so a replay is stale), a buffer named is one the peer has sent (or is sending) its descriptor for,
and an ack names a buffer this rank is waiting on that peer to read. Anything else is dropped and counted
(`dropped`), and every descriptor that arrives is closed. The buffers each rank makes are bounded, and
every send and wait has the group's deadline.

Used where every rank of a group is on this host and kernel (hostname, boot id and network namespace
agree: the socket names are abstract ones), for CPU tensors on gloo; `PARDSL_SHARED_MEMORY=0` turns it off.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import secrets
import socket
import stat
import struct
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from pardsl.layouts.algebra import block_lengths, chunk_of_block
from pardsl.runtime.collectives import all_gather_json

# a datagram's kind: that a buffer has been read, or that one holds the sender's input to one of these
_READ = 0
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# kind, sender's rank in the group, collective number, sender's buffer, its capacity, bytes of input
_MESSAGE = struct.Struct("<iiqqqq")
_CREDENTIALS = struct.Struct("iII")  # struct ucred: pid, uid, gid
# Room for the sender's credentials and a few descriptors: a peer sends at most one, and descriptors past the
# room are discarded by the kernel (MSG_CTRUNC) rather than installed in this process.
_ANCILLARY_SPACE = socket.CMSG_SPACE(_CREDENTIALS.size) + socket.CMSG_SPACE(4 * struct.calcsize("i"))
_POLL_S = 1.0  # how often a wait or a send checks that its peers are still alive
_MAX_BUFFERS = 64  # per rank: a step's collectives in flight at once use a handful
_MAX_CAPACITY = 1 << 40  # a buffer's bytes, as a peer may announce them
_MAX_VIEWS = 512  # typed views kept (a step's collectives use a few dozen sizes)
# How long a wait reads without blocking before it sleeps on the socket. Waking a rank from a blocking read
# takes 30-70 µs here, on the path of every forward all-reduce of tensor parallelism; a peer that arrives
# within this long is seen at once (Megatron TP step on LLaMA, nine in-process A/B runs: a median of
# -1.6 ms of 43, seven of the nine faster). Only where each rank of the group on this host can have a
# core: a spinning rank would otherwise take the core its peer needs to arrive.
_SPIN_S = 100e-6
_PAGE = 4096

# per process group (weakly: a group destroyed and another made in its place, at the same address, gets its own)
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def enabled() -> bool:
    return os.environ.get("PARDSL_SHARED_MEMORY", "1") != "0"


def _host_identity():
    """What ranks share when their abstract Unix sockets reach each other and a memfd passed between them
    maps the same memory: one kernel (boot id) and one network namespace; and one pid namespace, where a
    wait looks its peers' processes up. None where that cannot be told."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        os.close(os.memfd_create("pardsl-probe", os.MFD_CLOEXEC))  # where it is refused, there is no transport
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        return socket.gethostname(), boot_id, os.stat("/proc/self/ns/net").st_ino, os.stat("/proc/self/ns/pid").st_ino
    except (OSError, AttributeError):
        return None


def shared_memory_group(group) -> SharedMemoryGroup | None:
    """The shared-memory transport of a gloo process group (None: the default group) whose ranks all share
    this host, or None where they do not, on another backend, or where it is turned off. Collective over
    the group the first time; one per group and process after that."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if dist.get_backend(group) != "gloo":
        return None
    if group not in _GROUPS:
        _GROUPS[group] = _made(group)
    return _GROUPS[group]


def _made(group) -> SharedMemoryGroup | None:
    # Each rank binds its socket to a name of its own before anyone learns it: a name another user could
    # work out beforehand (from another rank's, read in /proc/net/unix) could be bound first, and start-up
    # would fail with EADDRINUSE.
    identity = enabled() and _host_identity()
    own = bound_socket() if identity else None  # the socket, and its abstract name, are Linux's
    try:
        everyone = all_gather_json([identity, own.getsockname()[1:].hex() if own else "", os.getpid()], group)
        if len({json.dumps(identity) for identity, _, _ in everyone}) != 1 or not everyone[0][0]:
            if own is not None:
                own.close()
            return None
        try:  # a wait gives up when gloo's own would: after the group's timeout
            timeout_s = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            timeout_s = 1800.0  # torch's default for gloo
        addresses = [b"\0" + bytes.fromhex(name) for _, name, _ in everyone]
        made = SharedMemoryGroup(dist.get_rank(group), addresses, [pid for _, _, pid in everyone], timeout_s, own)
        dist.barrier(group=group)  # every rank's group is made before any is sent to
        return made
    except BaseException:
        if own is not None:
            own.close()
        raise


def bound_socket(address: bytes | None = None) -> socket.socket:
    """A datagram socket that is told its senders' credentials, bound to `address`, by default an abstract
    name of 128 random bits."""
    own = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    own.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # who sent each datagram, from the kernel
    own.bind(address if address is not None else b"\0pardsl-" + secrets.token_hex(16).encode())
    return own


@dataclasses.dataclass
class _Buffer:
    number: int
    memory: torch.Tensor  # uint8, the whole capacity
    unread: set = dataclasses.field(default_factory=set)  # ranks (this one too) yet to read what it holds now
    collective: int = -1  # the number of the collective it holds the input of
    fd: int | None = None  # until every peer has been sent it
    sent_to: set = dataclasses.field(default_factory=set)
    lent: weakref.ref | None = None  # the tensor it is lent as (`lend`), until a collective starts on it

    def free(self) -> bool:
        return not self.unread and (self.lent is None or self.lent() is None)


class SharedMemoryGroup:
    """The transport of one process group on one rank: its socket, its buffers and the peers' it has mapped."""

    def __init__(self, rank: int, addresses: list[bytes], pids: list[int], timeout_s: float = 1800.0,
                 own: socket.socket | None = None):
        """`addresses`: each rank's socket's; `own`: this rank's socket, bound to its address (bound here
        where not given)."""
        self.rank, self.size, self.pids, self.timeout_s = rank, len(pids), pids, timeout_s
        self.peers = [r for r in range(self.size) if r != rank]
        self._address = list(addresses)
        self._socket = own if own is not None else bound_socket(self._address[rank])
        self._uid = os.getuid()
        self._buffers: list[_Buffer] = []
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}  # (peer, its buffer) → the memory
        self._views: dict[tuple, torch.Tensor] = {}  # (buffer's key, bytes, dtype) → its first bytes as dtype
        # collective number → peer → (its buffer, bytes, which collective)
        self._ready: dict[int, dict[int, tuple[int, int, str]]] = {}
        self._expected = {peer: 0 for peer in self.peers}  # the next collective number each peer announces
        self._started = 0
        self.dropped: collections.Counter = collections.Counter()  # datagrams not believed, by reason
        self._lock = threading.Lock()
        self.spin_s = spin_seconds(self.size, len(os.sched_getaffinity(0)))

    # -- the collectives: start one, then wait on the work it returns ---------------------------------

    def lend(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor that lies in one of this rank's buffers: a collective's input written into it (a bucket
        of gradients) is not copied into a buffer when the collective starts on it (on it whole: a view of
        it of the same bytes), so it must not be written once that has started. Until then, or until it is
        dropped, the buffer is not used for another."""
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            self._receive(block=False)
            buffer = self._free_buffer(nbytes)
            lent = self._typed(("own", buffer.number), buffer.memory, nbytes, dtype).view(shape)
            buffer.lent = weakref.ref(lent)
        return lent

    def all_reduce_started(self, x: torch.Tensor, overwrite: bool = True):
        """(work, a function giving the sum of x over the group once waited on); `overwrite`: the sum may
        be written into x."""
        # this rank's input is read from its buffer, so x may take the sum; but not where x is that buffer
        # (lent), which the peers read
        overwrite = overwrite and self._lent_buffer(x) is None

        def summed(inputs):
            return _sum_in_rank_order(inputs, out=x.view(-1) if overwrite else None).view(x.shape)

        return self._started_work(x, summed, "all_reduce")

    def all_gather_started(self, out: torch.Tensor, x: torch.Tensor):
        """Gather x from every rank into `out` (rank r's at chunk r of dim 0): the work to wait on."""
        rows = out.view(self.size, -1)
        rows[self.rank].copy_(x.view(-1))

        def gathered(inputs):
            for peer in self.peers:
                rows[peer].copy_(inputs[peer])
            return out

        return self._started_work(x, gathered, "all_gather")[0]

    def reduce_scatter_started(self, moved: torch.Tensor):
        """(work, a function giving this rank's chunk of dim 0 of the sum of `moved` once waited on)."""
        return self.reduce_scatter_along(moved, 0)

    def all_gather_along(self, x: torch.Tensor, dim: int, blocks: int | tuple[int, ...] = 1,
                         mirrored: bool = False) -> torch.Tensor:
        """x gathered along `dim` (blocks-major: block b of the result holds block b of every rank's x, in
        rank order), written from each rank's buffer straight into its place: the tensor is never moved
        to put `dim` first and back, as a gather of dim 0 needs. `blocks`: a count, or unequal sizes."""
        x = x.contiguous()
        chunks = block_lengths(x.shape[dim], blocks)  # this rank's chunk of each block
        starts = [sum(chunks[:b]) for b in range(len(chunks))]
        shape = list(x.shape)
        shape[dim] *= self.size
        out = x.new_empty(shape)

        def gathered(inputs):
            for r, flat in enumerate(inputs):
                theirs = flat.view(x.shape)
                for b, chunk in enumerate(chunks):
                    where = (starts[b] * self.size + chunk_of_block(b, r, self.size, mirrored) * chunk)
                    out.narrow(dim, where, chunk).copy_(theirs.narrow(dim, starts[b], chunk))
            return out

        work, result = self._started_work(x, gathered, "all_gather")
        return result()

    def reduce_scatter_along(self, x: torch.Tensor, dim: int, blocks: int | tuple[int, ...] = 1,
                             mirrored: bool = False):
        """(work, a function giving this rank's part of the sum of x over the group along `dim` once
        waited on: of each of the `blocks` blocks of dim, chunk `rank`), summed from the ranks' buffers
        straight into its place, without moving `dim` first and back. `blocks`: a count, or unequal sizes."""
        x = x.contiguous()
        whole = block_lengths(x.shape[dim], blocks)
        chunks = [length // self.size for length in whole]
        shape = list(x.shape)
        shape[dim] = sum(chunks)

        def scattered(inputs):
            out = x.new_empty(shape)
            parts = [flat.view(x.shape) for flat in inputs]
            for b, chunk in enumerate(chunks):
                where = sum(whole[:b]) + chunk_of_block(b, self.rank, self.size, mirrored) * chunk
                _sum_in_rank_order([part.narrow(dim, where, chunk) for part in parts],
                                   out=out.narrow(dim, sum(chunks[:b]), chunk))
            return out

        return self._started_work(x, scattered, "reduce_scatter")

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        """Chunk r of dim 0 of `sent` to rank r; rank r's chunk for this one into chunk r of `received`."""
        rows = received.view(self.size, -1)

        def exchanged(inputs):
            for r, each in enumerate(inputs):
                rows[r].copy_(each.view(self.size, -1)[self.rank])
            return received

        self._started_work(sent, exchanged, "all_to_all")[0].wait()

    # -- how -------------------------------------------------------------------------------------------

    def _started_work(self, x: torch.Tensor, result, collective: str):
        x = x.contiguous().view(-1)
        nbytes = x.numel() * x.element_size()
        with self._lock:
            self._receive(block=False)  # the peers' reads of earlier collectives free buffers
            buffer = self._lent_buffer(x)
            if buffer is None:
                buffer = self._free_buffer(nbytes)
                mine = self._typed(("own", buffer.number), buffer.memory, nbytes, x.dtype)
                mine.copy_(x)
            else:  # x was written where the peers read it
                mine = x
            buffer.lent = None
            buffer.unread = set(range(self.size))
            number = self._started
            buffer.collective = number
            self._started += 1
            for peer in self.peers:
                fd = buffer.fd if peer not in buffer.sent_to else None
                self._send(peer, 1 + _COLLECTIVES.index(collective), number, buffer.number, buffer.memory.numel(),
                           nbytes, fd)
                buffer.sent_to.add(peer)
            if buffer.fd is not None and len(buffer.sent_to) == len(self.peers):
                os.close(buffer.fd)  # each peer holds its own copy of the descriptor now
                buffer.fd = None
        work = _Work(lambda: self._wait(number, buffer, mine, result, collective))
        return work, work.result

    def _lent_buffer(self, x: torch.Tensor) -> _Buffer | None:
        """The buffer x was lent as (`lend`), where x is the whole of it."""
        for buffer in self._buffers:
            lent = buffer.lent() if buffer.lent is not None else None
            if lent is not None and x.data_ptr() == lent.data_ptr() and x.numel() == lent.numel() \
                    and x.dtype == lent.dtype and x.is_contiguous():
                return buffer
        return None

    def _free_buffer(self, nbytes: int) -> _Buffer:
        capacity = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        # no more than twice the size: a small collective in a large buffer would have the next large one
        # make another
        fitting = [b for b in self._buffers if b.free() and capacity <= b.memory.numel() <= 2 * capacity]
        if fitting:
            return min(fitting, key=lambda b: b.memory.numel())
        if len(self._buffers) >= _MAX_BUFFERS:
            return self._buffer_read_again(capacity)
        fd, memory = self._shared_memory(len(self._buffers), capacity)
        buffer = _Buffer(len(self._buffers), memory, fd=fd)
        self._buffers.append(buffer)
        return buffer

    def _buffer_read_again(self, capacity: int) -> _Buffer:
        """With every buffer made: the first free one large enough, once the peers have read it (a program
        with more collectives in flight than _MAX_BUFFERS waits for the oldest, as gloo's queue would)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            free = [b for b in self._buffers if b.free()]
            fitting = [b for b in free if b.memory.numel() >= capacity]
            if fitting:
                return min(fitting, key=lambda b: b.memory.numel())
            if free:  # all too small: the smallest is made again at this size (the peers map it anew)
                return self._remade(min(free, key=lambda b: b.memory.numel()), capacity)
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank} of a shared-memory group waited {self.timeout_s:.0f} s "
                                   f"for its peers to read one of its {_MAX_BUFFERS} buffers")
            self._receive(block=True)
            self._check_peers_alive()

    def _remade(self, buffer: _Buffer, capacity: int) -> _Buffer:
        fd, memory = self._shared_memory(buffer.number, capacity)
        if buffer.fd is not None:
            os.close(buffer.fd)
        remade = _Buffer(buffer.number, memory, fd=fd)  # sent_to empty: each peer is sent the new descriptor
        self._buffers[buffer.number] = remade
        self._views = {key: view for key, view in self._views.items() if key[0] != ("own", buffer.number)}
        return remade

    def _shared_memory(self, number: int, capacity: int) -> tuple[int, torch.Tensor]:
        """A memfd of `capacity` bytes for buffer `number`, and this process's mapping of it."""
        fd = os.memfd_create(f"pardsl-{self.rank}-{number}", os.MFD_CLOEXEC)
        os.ftruncate(fd, capacity)
        return fd, torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=capacity, dtype=torch.uint8)

    def _typed(self, key: tuple, memory: torch.Tensor, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer's first `nbytes` as `dtype`, made once: a step's collectives use the same few buffers at
        the same sizes, and a slice and a view made afresh are two ATen ops each time (about 13 µs here)."""
        view = self._views.get((key, nbytes, dtype))
        if view is None:
            if len(self._views) >= _MAX_VIEWS:  # sizes that keep changing: start the cache again
                self._views.clear()
            view = self._views[(key, nbytes, dtype)] = memory[:nbytes].view(dtype)
        return view

    def _send(self, peer: int, kind: int, number: int, buffer: int, capacity: int = 0, nbytes: int = 0,
              fd: int | None = None, gone_ok: bool = False) -> None:
        """`gone_ok`: a peer whose socket is gone needs no such message (a read acknowledgement after the
        group's last collective, which the peer finished first and then ended: its buffer stays mapped here
        until read)."""
        message = _MESSAGE.pack(kind, self.rank, number, buffer, capacity, nbytes)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))] if fd is not None else []
        deadline = time.monotonic() + self.timeout_s
        checked = time.monotonic()
        while True:
            try:
                self._socket.sendmsg([message], ancillary, socket.MSG_DONTWAIT, self._address[peer])
                return
            except BlockingIOError:  # the peer's queue is full: take in ours meanwhile, so both can go on
                self._receive(block=False)
                time.sleep(0.0001)
            except (ConnectionRefusedError, FileNotFoundError) as error:  # its socket is gone
                if gone_ok:
                    return
                raise RuntimeError(f"rank {self.rank} of a shared-memory group cannot reach rank {peer} "
                                   f"(process {self.pids[peer]}): {error}") from None
            if time.monotonic() - checked > _POLL_S:
                self._check_peers_alive()
                checked = time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank} of a shared-memory group could not send to rank {peer} for "
                                   f"{self.timeout_s:.0f} s (the process group's timeout): its queue stayed full")

    def _receive(self, block: bool, timeout_s: float = _POLL_S) -> None:
        """Take in the datagrams that have arrived (with `block`, waiting up to `timeout_s` for the first)."""
        while True:
            try:
                # socket.recv_fds drops its flags (Python 3.11), so recvmsg itself; one byte more than a
                # message, so that a longer datagram shows as such rather than cut to size
                if block:
                    self._socket.settimeout(max(timeout_s, 1e-3))
                    message, ancillary, flags, _ = self._socket.recvmsg(_MESSAGE.size + 1, _ANCILLARY_SPACE)
                else:
                    message, ancillary, flags, _ = self._socket.recvmsg(_MESSAGE.size + 1, _ANCILLARY_SPACE,
                                                                        socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError, TimeoutError):
                return
            finally:
                self._socket.settimeout(None)
            fds, credentials = [], None
            for level, kind_of, data in ancillary:
                if (level, kind_of) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True)
                            for i in range(0, len(data) - len(data) % 4, 4)]
                elif (level, kind_of) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS) \
                        and len(data) >= _CREDENTIALS.size:
                    credentials = _CREDENTIALS.unpack_from(data)
            try:
                reason = self._accept(message, flags, credentials, fds)
            except Exception as error:  # noqa: BLE001 - whatever a datagram holds, it is not believed
                reason = f"not usable ({type(error).__name__})"
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            if reason is not None:
                self.dropped[reason] += 1
            block = False

    def _accept(self, message: bytes, flags: int, credentials, fds: list[int]) -> str | None:
        """Take in one datagram if it is a peer's and makes sense now; else the reason it is dropped."""
        if credentials is None:
            return "no credentials"
        pid, uid, _ = credentials
        if uid != self._uid or pid not in self.pids:
            return "not from a peer's process"
        if len(message) != _MESSAGE.size or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            return "malformed"
        kind, peer, number, buffer, capacity, nbytes = _MESSAGE.unpack(message)
        if peer not in self._expected or self.pids[peer] != pid:
            return "sender's rank and process disagree"
        if kind == _READ:
            if not (0 <= buffer < len(self._buffers)) or peer not in self._buffers[buffer].unread \
                    or self._buffers[buffer].collective != number or fds:
                return "an ack of nothing awaited"
            self._buffers[buffer].unread.discard(peer)
            return None
        if not 1 <= kind <= len(_COLLECTIVES):
            return "unknown kind"
        if number != self._expected[peer]:
            return "out of order or replayed"
        if not (0 <= buffer < _MAX_BUFFERS and 0 < capacity <= _MAX_CAPACITY and capacity % _PAGE == 0
                and 0 <= nbytes <= capacity) or len(fds) > 1:
            return "out of range"
        if fds:
            status = os.fstat(fds[0])
            if not stat.S_ISREG(status.st_mode) or status.st_size < capacity:
                return "not a buffer"
            # the peer's memory, mapped here to read: outside any dispatch mode, so that a rank's measured
            # memory (pardsl/tools/memory.py) counts its own buffers and not its peers'
            with _disable_current_modes():
                memory = torch.from_file(f"/proc/self/fd/{fds[0]}", shared=True, size=capacity, dtype=torch.uint8)
            self._mapped[(peer, buffer)] = memory
            self._views = {key: view for key, view in self._views.items() if key[0] != (peer, buffer)}
        mapped = self._mapped.get((peer, buffer))
        if mapped is None or mapped.numel() != capacity:
            return "a buffer not mapped"
        self._expected[peer] += 1
        self._ready.setdefault(number, {})[peer] = (buffer, nbytes, _COLLECTIVES[kind - 1])
        return None

    def _check_peers_alive(self) -> None:
        for peer in self.peers:
            try:
                with open(f"/proc/{self.pids[peer]}/stat") as stat_file:
                    state = stat_file.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "gone"
            if state in ("Z", "X", "gone"):
                raise RuntimeError(f"rank {peer} of a shared-memory group ended (process {self.pids[peer]}) "
                                   "while this rank waited on a collective with it")

    def _wait(self, number: int, buffer: _Buffer, mine: torch.Tensor, result, collective: str):
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            spin_until = time.perf_counter() + self.spin_s
            checked = time.monotonic()
            while len(self._ready.get(number, ())) < len(self.peers):
                if time.perf_counter() < spin_until:
                    self._receive(block=False)
                    continue
                now = time.monotonic()
                if now > deadline:
                    missing = sorted(set(self.peers) - set(self._ready.get(number, ())))
                    raise RuntimeError(f"rank {self.rank} of a shared-memory group waited {self.timeout_s:.0f} s (the "
                                       f"process group's timeout) for rank(s) {missing} to start collective number "
                                       f"{number}, {collective}")
                if now - checked >= _POLL_S:  # also while datagrams keep arriving, none of them the one awaited
                    self._check_peers_alive()
                    checked = now
                self._receive(block=True, timeout_s=min(_POLL_S, deadline - now))
            ready = self._ready.pop(number)
            nbytes = mine.numel() * mine.element_size()
            for peer, (_, theirs, their_collective) in ready.items():
                if (their_collective, theirs) != (collective, nbytes):
                    # gloo would hang or fail somewhere inside; this says which ranks disagree on what
                    raise RuntimeError(f"collective number {number} of a shared-memory group: rank {peer} started "
                                       f"{their_collective} of {theirs} bytes, rank {self.rank} {collective} "
                                       f"of {nbytes} bytes (the ranks issued different collectives)")
            inputs = [mine if r == self.rank else self._typed((r, ready[r][0]), self._mapped[(r, ready[r][0])],
                                                              ready[r][1], mine.dtype)
                      for r in range(self.size)]
            value = result(inputs)
            buffer.unread.discard(self.rank)
            for peer in self.peers:
                self._send(peer, _READ, number, ready[peer][0], gone_ok=True)
            return value


def spin_seconds(ranks: int, cores: int) -> float:
    """How long a wait of a group of `ranks` ranks on this host, each able to run on `cores` cores, reads
    before it blocks: `_SPIN_S` where every rank can have a core, else not at all."""
    return _SPIN_S if ranks <= cores else 0.0


def _sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """parts[0] + parts[1] + ..., left to right: the same bits on every rank that sums the same parts."""
    total = torch.add(parts[0], parts[1], out=out)
    for more in parts[2:]:
        total.add_(more)
    return total


class _Work:
    """A started collective, as torch.distributed's work: wait() once its result is wanted."""

    def __init__(self, finish):
        self._finish, self._value = finish, None

    def wait(self) -> bool:
        if self._finish is not None:
            self._value = self._finish()
            self._finish = None
        return True

    def result(self):
        self.wait()
        return self._value
