"""A task's targets laid out on a runner (queue/pg/inputs.py, `unpack`): a path whose shape the
file system refuses is the task's (InvalidInput), a host that fails while writing is not
(InfraError naming the path and the errno): a full disk must not fail a task for good. A real
full disk, a 256 KiB tmpfs (skipped where this process may not mount). No database.

Cost in the default run: about 0.1 s (one mount, a few small writes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from fila.core.errors import InfraError, InvalidInput
from fila.queue.pg.inputs import unpack
from tests.support.tmpfs import small_tmpfs

BIG = {"max_files": 1000, "max_bytes": 1 << 20}


class Source:
    def __init__(self, *blobs: bytes) -> None:
        self.blobs = {hashlib.sha256(b).hexdigest(): b for b in blobs}

    def blob(self, sha256: str) -> bytes:
        return self.blobs[sha256]


def entry(path: str, data: bytes) -> dict[str, Any]:
    return {
        "path": path,
        "kind": "file",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "mode": 0o644,
    }


def manifest(*entries: dict[str, Any]) -> bytes:
    return json.dumps({"version": 1, "targets": ["."], "entries": list(entries)}).encode()


def test_a_full_disk_is_the_hosts_failure_and_a_bad_path_the_tasks(tmp_path: Path) -> None:
    small, big = b"hello\n", b"x" * 400_000

    class Hungry(Source):  # a host out of memory while it fetches: the host's too
        def blob(self, sha256: str) -> bytes:
            raise MemoryError

    with pytest.raises(InfraError, match="ran out of memory"):
        unpack(Hungry(), manifest(entry("a/x.txt", small)), tmp_path / "mem", **BIG)
    with small_tmpfs(tmp_path / "disk") as disk:
        # The allowed counterpart: what fits is laid out.
        assert unpack(Source(small), manifest(entry("a/x.txt", small)), disk / "ok", **BIG) == ["a"]
        assert (disk / "ok" / "a" / "x.txt").read_bytes() == small
        # A path named both as a file and as a directory is still the task's, on the same disk.
        with pytest.raises(InvalidInput, match="cannot be laid out"):
            unpack(Source(small), manifest(entry("a", small), entry("a/x.txt", small)), disk / "twice", **BIG)
        # The same shape of manifest, over what the disk holds: the host's (ENOSPC), with the path.
        with pytest.raises(InfraError, match=r"full.bin could not be written on this host \(ENOSPC"):
            unpack(Source(big), manifest(entry("a/full.bin", big)), disk / "full", **BIG)
