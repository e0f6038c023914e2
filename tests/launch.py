"""Run a script under torch's launcher (torchrun) on N local gloo ranks, with a timeout."""

import os
import subprocess
import sys

from pardsl.pool import free_port

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
