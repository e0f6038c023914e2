"""Where the ranks of one machine meet: a file only this user can open, never a network port.

torch's TCPStore, what torchrun and `init_method="tcp://..."` meet through, listens on a port that any
user of the machine can connect to without a password, and torch's elastic launcher keeps its rendezvous
state there as a pickle that it loads: whoever writes that key runs code as the run's user. Ranks that
share a machine need no port to meet. They meet in a FileStore inside a folder that only this user can
open (mode 0700, made by mkdtemp, checked again before use), so another user can neither read nor write
what they exchange there.

Ranks on several machines must meet over the network: that is torchrun's rendezvous, on the cluster's
private network (docs/security.md says what that trusts).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import stat
import tempfile
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def private_folder(prefix: str) -> Iterator[str]:
    """A new folder that only this user can open, removed with what it holds when the block ends."""
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        status = os.lstat(folder)
        # mkdtemp makes it 0700 and ours; a umask or a file system that says otherwise is refused
        if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.geteuid() or status.st_mode & 0o077:
            raise PermissionError(f"{folder} is not a private folder (owner {status.st_uid}, mode "
                                  f"{stat.filemode(status.st_mode)}): set TMPDIR to a folder of your own")
        yield folder


def init_local_ranks(backend: str, folder: str, rank: int, world_size: int, timeout_s: float) -> None:
    """This process's default process group, met through the FileStore in `folder`. gloo's connections
    between the ranks stay on the loopback interface (unless GLOO_SOCKET_IFNAME says otherwise): by default
    gloo listens on the address the host name resolves to, which other machines can reach."""
    if backend == "gloo" and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    # the store made here, not named by a file:// address: a folder under a TMPDIR with `?` or `#` in its
    # name is a query or a fragment in an address, and torch's parsing of it failed with an IndexError.
    # The prefix is the one torch gives a store it makes from an address.
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
