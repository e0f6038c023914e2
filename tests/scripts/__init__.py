"""What the tests run on every rank, in their worker pool or as scripts under torchrun, and how such a
script ends."""

import os
import sys

import torch.distributed as dist


def shut_down() -> None:
    """Every rank done communicating, the process groups destroyed, then the process ended without the
    interpreter's finalization. Under load, gloo work objects still referenced from Python (a schedule's
    sends, a bucket's all-reduce) were freed during finalization and aborted a rank after its results were
    written: "terminate called without an active exception" (pytorch/pytorch#179291). The results are
    files, closed before this is called."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
