"""What the daemon holds for a queue root: its containers, its work volumes, the starts it sees."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import docker

from fila.core.layout import Root


def reaped(spares: Path, timeout_s: float = 60.0) -> None:
    """Wait until the reapers a one-shot `fila` left in `spares` (its root's sandbox/spares) are
    done (sandbox/docker/reap.py): what they remove is gone, or left for a check to name."""
    from fila.sandbox.gateways import busy

    deadline = time.monotonic() + timeout_s
    while busy(spares) and time.monotonic() < deadline:
        time.sleep(0.05)


def reapers(needle: str) -> list[int]:
    """The processes whose command line holds `needle` (a reaper's lock path, or
    "fila.sandbox.docker.reap" for any): their pids."""
    pids = []
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if d.name.isdigit() and needle.encode() in (d / "cmdline").read_bytes():
                pids.append(int(d.name))
    return pids


def containers_left(client: docker.DockerClient, root: Root) -> list[str]:
    """fila's containers of this root, in any state (once its reapers are done)."""
    reaped(root.spares_dir)
    return [c.name for c in client.containers.list(all=True, filters={"label": [f"fila.root={root.path}"]})]


def volumes_left(client: docker.DockerClient, root: Root) -> list[str]:
    """fila's work volumes of this root."""
    return [v.name for v in client.volumes.list(filters={"label": f"fila.root={root.path}"})]


class Starts:
    """Counts the containers of one root that the daemon starts, from its live event stream
    (not from fila's records, and not from its short replay buffer, which other tests fill)."""

    def __init__(self, client: docker.DockerClient, root: Root) -> None:
        self.n = 0
        self._stream = client.events(
            decode=True, filters={"event": "start", "label": [f"fila.root={root.path}"]}
        )
        self._thread = threading.Thread(target=self._count, daemon=True)
        self._thread.start()

    def _count(self) -> None:
        with contextlib.suppress(Exception):  # the stream ends when closed
            for _ in self._stream:
                self.n += 1

    def count(self) -> int:
        time.sleep(0.5)  # the daemon sends the event right after the start returns
        return self.n

    def close(self) -> None:
        self._stream.close()


@contextlib.contextmanager
def held_elsewhere(path: Path) -> Iterator[Callable[[], None]]:
    """Another process holds the file lock `path` (a plain flock, as a fila of another queue
    root or user would: sandbox/docker/removal.departure) from the block's start until the
    function it yields is called, or the block ends."""
    code = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT, 0o666)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def release() -> None:
        if p.stdin is not None and not p.stdin.closed:
            p.stdin.close()
        p.wait(timeout=10)

    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        yield release
    finally:
        release()
