"""Run a script under torch's launcher (torchrun) on N local gloo ranks, with a timeout."""

import contextlib
import os
import signal
import subprocess
import sys

from pardsl.runtime.devices import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(nproc: int, script: str, *args: str, timeout: float = 300, nnodes: int = 1) -> str:
    """The run's output; fails the test with it where the run fails or outlasts `timeout`."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command[3:])} failed:\n{output[-6000:]}"
    return output


def torchrun_agents(nnodes: int, nproc: int, script: str, *args: str, max_restarts: int = 0,
                    timeout: float = 300) -> list[str]:
    """`nnodes` torchrun agents on this host meeting at one rendezvous, as `nnodes` machines would; each
    agent's output. Fails the test where an agent fails or outlasts `timeout`."""
    endpoint = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=test-{os.getpid()}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.2", script, *args]
    # each restart's workers meet in a store of their own: in the one the agents share, a healthy agent's
    # restarted workers and a failed one's count attempts differently and can read stale addresses
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True) for _ in range(nnodes)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                for pid in [*_descendants(agent.pid), agent.pid]:  # workers may sit in sessions of their own
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                agent.wait()
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, f"an agent of {' '.join(command[3:])} failed:\n{output[-6000:]}"
    return outputs


def _descendants(pid: int) -> list[int]:
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found
