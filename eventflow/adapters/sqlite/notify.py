"""Wake-ups across processes for a SQLite file's outbox: SQLite's stand-in for PostgreSQL's
LISTEN/NOTIFY.

The process whose relay holds the outbox lease binds a datagram socket named after the
database file (``Listener``, for as long as it relays); a store of another process (or
another store object on the file) that committed outbox rows sends it one byte right
after the commit, from the database thread (``announce``). The relay hears it a few
microseconds later, where the outbox's high-water mark check (``outbox.py``), a poll, finds
a row 0.1 ms after its commit on average and costs CPU while it polls. That check stays as
the safety net: for systems without the socket (the names are Linux's abstract sockets:
no file to create or clean up), processes in other network namespaces (containers sharing
a volume), and a datagram lost.

The name comes from the file's device and inode, the same for every path to it. Sending
costs one system call of a few microseconds; when nobody listens it fails at once and is
ignored, as is a full buffer (the relay has a wake-up pending then).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Callable
from contextlib import suppress

__all__ = ["Listener", "address", "announce"]


def address(path: str) -> bytes | None:
    """The socket name of the database file ``path``, or None where there is none (not
    Linux, a database in memory, the file gone)."""
    if not sys.platform.startswith("linux") or path == ":memory:":
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return b"\0eventflow-sqlite-outbox-%d-%d" % (st.st_dev, st.st_ino)


class _Sender:
    """One unbound datagram socket per process, shared by every store (sending from
    several threads at once is safe)."""

    sock: socket.socket | None = None

    @classmethod
    def send(cls, name: bytes) -> None:
        sock = cls.sock
        if sock is None:
            sock = cls.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
        # Refused: nobody listens; a full buffer: the relay has a wake-up pending.
        with suppress(OSError):
            sock.sendto(b"!", name)


def announce(name: bytes | None) -> None:
    """Tell the relay listening on ``name`` (if any) that outbox rows were committed."""
    if name is not None:
        _Sender.send(name)


class Listener:
    """The relay's socket: ``wake()`` is called in the event loop on each announcement."""

    def __init__(self, name: bytes, wake: Callable[[], None]) -> None:
        self._name = name
        self._wake = wake
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> bool:
        """Bind and listen; False if the name is taken (another relay of this file still
        listens: the high-water mark check wakes this one)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(self._name)
        except OSError:
            sock.close()
            return False
        sock.setblocking(False)
        self._sock, self._loop = sock, asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable)
        return True

    def stop(self) -> None:
        """Stop listening and free the name. Idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None and self._loop is not None:
            self._loop.remove_reader(sock.fileno())
            sock.close()

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        with suppress(OSError):  # drained (BlockingIOError)
            while sock.recv(64):
                pass
        self._wake()
