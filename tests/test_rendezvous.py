"""Where a run's ranks meet: no TCP port of `pardsl run` or of the worker pool answers torch's store
protocol, which anyone on the machine could use to read and replace what the ranks exchange (torch's
elastic launcher loads a pickle from it: code run as the run's user)."""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from tests.launch import REPO, _descendants


# 127.0.0.1 and ::1 as /proc/net/tcp and tcp6 write them
_LOOPBACK = {"0100007F", "00000000000000000000000001000000"}


def _listening_tcp_ports(pids: list[int], loopback: bool | None = None) -> set[int]:
    """The TCP ports these processes listen on (IPv4 and IPv6), from their descriptors and /proc/net;
    `loopback`: only those on a loopback address (True) or on another (False)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:["):-1]))
        except OSError:  # ended meanwhile
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                address, port = fields[1].rsplit(":", 1)
                on_loopback = address in _LOOPBACK
                if fields[3] == "0A" and int(fields[9]) in inodes and loopback in (None, on_loopback):  # LISTEN
                    ports.add(int(port, 16))
    return ports


_STORE_PROBE = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=5),
                      wait_for_workers=False)
store.set("pardsl-probe", "1")
sys.exit(0 if store.get("pardsl-probe") == b"1" else 1)
"""


def _answering_as_a_store(ports) -> set[int]:
    """The ports where a TCPStore client, as any local user could run one, writes and reads a key back.
    Each probe is a process of its own, ended after 10 s: a client that reached another protocol's port
    (gloo's) can wait on it past its own timeout."""
    probes = {port: subprocess.Popen([sys.executable, "-c", _STORE_PROBE, str(port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL) for port in ports}
    answered = set()
    for port, probe in probes.items():
        try:
            if probe.wait(timeout=10) == 0:
                answered.add(port)
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.wait()
    return answered


def _ports_while_ranks_meet(root: int, ranks: int, deadline_s: float = 120) -> set[int]:
    """Every port the process tree under `root` listens on, watched until `ranks` of its processes listen
    (their process group is up: gloo's own connections)."""
    seen = set()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        tree = [root, *_descendants(root)]
        seen |= _listening_tcp_ports(tree)
        if sum(1 for pid in tree if _listening_tcp_ports([pid])) >= ranks:
            break
        time.sleep(0.2)
    return seen


@pytest.mark.slow
def test_no_port_of_a_run_answers_as_a_store(tmp_path):
    # a run whose ranks meet and then wait (rank 1 sleeps in its model, rank 0 in a collective): kept up
    # while the ports are probed without taking the cores a training loop would
    path = tmp_path / "waiting.par"
    path.write_text('mesh tp = 2\nmodel tests.zoo:Faulty(kind="sleep", rank=1)\ninput x : float32[2, 4]\n'
                    "layout {\n  lin.weight : S(0)\n}\n")
    process = subprocess.Popen([sys.executable, "-m", "pardsl.cli", "run", str(path), "--nproc", "2",
                                "--stall-timeout", "600"], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        seen = _ports_while_ranks_meet(process.pid, ranks=2)
        assert process.poll() is None, "the run ended before its ranks were seen meeting"
        assert seen, "no rank was seen listening: the check saw nothing"
        assert _answering_as_a_store(seen) == set()
        assert _listening_tcp_ports([process.pid, *_descendants(process.pid)], loopback=False) == set()
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.slow
def test_no_port_of_the_worker_pool_answers_as_a_store():
    from pardsl.tools.pool import WorkerPool

    pool = WorkerPool(2, timeout_s=30)
    try:
        assert pool.run_on_every_rank(_rank_of_the_default_group) == [0, 1]  # the group is up
        ranks = [process.pid for process in pool._processes]
        ports = _listening_tcp_ports(ranks + [os.getpid()])
        assert ports, "the ranks listen for gloo's connections: the check sees them"
        assert _answering_as_a_store(ports) == set()
        assert _listening_tcp_ports(ranks, loopback=False) == set()  # other machines reach none of them
    finally:
        pool.close()


def _rank_of_the_default_group() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_the_meeting_folder_is_this_users_alone_and_refused_otherwise(tmp_path, monkeypatch):
    from pardsl.runtime.rendezvous import private_folder

    with private_folder("pardsl-test-") as folder:
        status = os.stat(folder)
        assert status.st_uid == os.geteuid() and stat.S_IMODE(status.st_mode) == 0o700
    assert not os.path.exists(folder)
    # a umask cannot open it up: mkdtemp's mode is 0700 whatever the umask
    previous = os.umask(0)
    try:
        with private_folder("pardsl-test-") as folder:
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    finally:
        os.umask(previous)
    import tempfile

    made = tempfile.mkdtemp

    def opened_to_everyone(*args, **kwargs):  # as a file system that ignores modes would give it
        path = made(*args, **kwargs)
        os.chmod(path, 0o777)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", opened_to_everyone)
    with pytest.raises(PermissionError, match="is not a private folder"):
        with private_folder("pardsl-test-"):
            pass


def test_ranks_meet_under_a_temporary_folder_whose_name_an_address_would_misread(tmp_path):
    """The meeting folder lies under TMPDIR, whose name may hold what a file:// address reads as a query, a
    fragment or an escape (`?`, `#`, `%`): the ranks meet there all the same (through such an address,
    torch's parsing failed with an IndexError)."""
    odd = tmp_path / "a?b#c%20d"
    odd.mkdir()
    result = subprocess.run([sys.executable, "-m", "pardsl.cli", "run", "examples/mlp.par", "--nproc", "2",
                             "--steps", "1", "--timeout", "60"], cwd=REPO, capture_output=True, text=True,
                            timeout=200, env={**os.environ, "TMPDIR": str(odd)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "on 2 ranks (gloo): equivalent to serial" in result.stdout
