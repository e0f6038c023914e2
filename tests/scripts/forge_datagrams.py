"""An attacker on the same host: forged, truncated, out-of-range and descriptor-laden datagrams sent to a
shared-memory group's sockets. Plain Python, no torch, so that another user's system Python runs it.

    python3 forge_datagrams.py NAME...    (each rank's socket's abstract name, rank order, without its NUL)
"""

import os
import socket
import struct
import sys
import time

MESSAGE = struct.Struct("<iiqqqq")  # kind, sender's rank, collective number, buffer, capacity, bytes


def memfd_of_thousands(capacity: int = 4096) -> int:
    fd = os.memfd_create("forged")
    os.ftruncate(fd, capacity)
    os.pwrite(fd, struct.pack("<1024f", *([1000.0] * 1024)), 0)
    return fd


def main(names: list[str]) -> int:
    ranks = len(names)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    fd = memfd_of_thousands()
    sent = 0

    def send(target: int, payload: bytes, fds=()) -> None:
        nonlocal sent
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
        for _ in range(3):
            try:
                sender.sendmsg([payload], ancillary, socket.MSG_DONTWAIT, "\0" + names[target])
                sent += 1
                return
            except BlockingIOError:  # a full queue: the rank is not reading just now
                time.sleep(0.001)
            except OSError:  # no such socket (any more)
                return

    for target in range(ranks):
        other = (target + 1) % ranks
        for number in range(8):  # "rank `other`'s input to collective `number` is in this buffer of 1000.0"
            for buffer in (-1, 0, 1, 63):
                send(target, MESSAGE.pack(1, other, number, buffer, 4096, 16), [fd])
        send(target, b"abc")  # truncated
        send(target, MESSAGE.pack(1, other, 1, 0, 4096, 16) + b"!")  # too long
        send(target, MESSAGE.pack(9, other, 1, 0, 4096, 16))  # no such kind
        send(target, MESSAGE.pack(1, 7, 1, 0, 4096, 16), [fd])  # no such rank
        send(target, MESSAGE.pack(1, other, 1, 0, -4096, 16), [fd])  # negative capacity
        for _ in range(100):  # "your buffer -1 has been read"
            send(target, MESSAGE.pack(0, other, 1, -1, 0, 0))
        for number in range(8):
            send(target, MESSAGE.pack(0, other, number, 0, 0, 0))
        for _ in range(300):  # two descriptors each
            send(target, MESSAGE.pack(1, other, 2, 5, 4096, 16), [fd, fd])
    print(sent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
