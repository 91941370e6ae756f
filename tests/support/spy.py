"""What the code under test did, seen from inside this process: the files it read, the processes
it started, whether it returned. A test proves "without reading it" or "never blocks" with these,
not with a wall-clock bound on a busy machine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_READS = ("read", "pread", "readv", "preadv")


@dataclass
class Seen:
    reads: list[str] = field(default_factory=list)  # the path behind each read's fd
    processes: list[Any] = field(default_factory=list)  # each started process's argv

    def read(self, path: Path | str) -> bool:
        """Did the code read a byte (ask for one) of `path`?"""
        return os.path.realpath(path) in self.reads


@contextlib.contextmanager
def watch() -> Iterator[Seen]:
    """Record, while the block runs, every os.read/pread/readv/preadv this process makes (by the
    path of its fd) and every process it starts (subprocess.Popen)."""
    seen = Seen()
    saved = {name: getattr(os, name) for name in _READS if hasattr(os, name)}
    popen_init = subprocess.Popen.__init__

    def spy(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(fd: int, *a: Any, **kw: Any) -> Any:
            with contextlib.suppress(OSError):
                seen.reads.append(os.readlink(f"/proc/self/fd/{fd}"))
            return real(fd, *a, **kw)

        return call

    def started(self: subprocess.Popen, args: Any, *a: Any, **kw: Any) -> None:
        seen.processes.append(args)
        popen_init(self, args, *a, **kw)

    try:
        for name, real in saved.items():
            setattr(os, name, spy(real))
        subprocess.Popen.__init__ = started  # type: ignore[method-assign]
        yield seen
    finally:
        for name, real in saved.items():
            setattr(os, name, real)
        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]


def finishes(fn: Callable[[], T], seconds: float = 20) -> T:
    """fn() in a daemon thread: a call that blocks (an open of a FIFO) fails the test after
    `seconds` instead of hanging the run; what it returned, or what it raised, raised here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:
            box["error"] = err

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked"
    if "error" in box:
        raise box["error"]
    return box["value"]
