"""Blobs: the bytes a reviewer needs (DIFF.patch, the log, the input manifest), stored once per
content under their sha256 and checked on the way in and on the way out (docs/architecture.md,
"The PostgreSQL queue"). The database checks the hash too (fila_blobs_hash)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from ...core.errors import InvalidInput
from ...core.states import valid_id
from .errors import BlobMismatch


@dataclass(frozen=True)
class Blob:
    """One named blob of a task: `name` (DIFF.patch, log, manifest...), its bytes, and the sha256
    the sender states (checked before anything is written)."""

    name: str
    data: bytes
    sha256: str

    @classmethod
    def of(cls, name: str, data: bytes) -> Blob:
        return cls(name, data, hashlib.sha256(data).hexdigest())


def check(blob: Blob, *, task_id: str | None = None) -> None:
    """BlobMismatch unless the bytes hash to the stated sha256; a bad name is refused too."""
    if not valid_id(blob.name):
        raise InvalidInput(f"blob name {blob.name!r} is not [A-Za-z0-9._-]{{1,128}}", task_id=task_id)
    actual = hashlib.sha256(blob.data).hexdigest()
    if actual != blob.sha256:
        raise BlobMismatch(
            f"blob {blob.name} ({len(blob.data)} bytes) hashes to sha256 {actual}, not the stated "
            f"{blob.sha256}; nothing was written",
            task_id=task_id,
            hint="the bytes changed on the way: send them again from the job directory",
        )


def put(cur: Any, task_id: str, attempt: int, blobs: list[Blob]) -> None:
    """Store `blobs` (already checked) and make them the task's whole blob set, inside the
    caller's transaction: an earlier attempt's blobs are no longer named, so none of them passes
    for this attempt's (their bytes stay, shared by content)."""
    cur.execute("DELETE FROM fila_task_blobs WHERE task_id = %s", (task_id,))
    for b in blobs:
        cur.execute(
            "INSERT INTO fila_blobs (sha256, size, data) VALUES (%s, %s, %s) ON CONFLICT (sha256) DO NOTHING",
            (b.sha256, len(b.data), b.data),
        )
        cur.execute(
            "INSERT INTO fila_task_blobs (task_id, name, sha256, attempt) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (task_id, name) DO UPDATE SET sha256 = excluded.sha256, attempt = excluded.attempt",
            (task_id, b.name, b.sha256, attempt),
        )


def put_missing(cur: Any, blobs: list[Blob]) -> tuple[int, int]:
    """Store the blobs (already checked) whose content the database does not hold yet, inside
    the caller's transaction: (how many were sent, their bytes). A content present already is
    not sent again."""
    wanted = {b.sha256: b for b in blobs}
    if not wanted:
        return 0, 0
    rows = cur.execute("SELECT sha256 FROM fila_blobs WHERE sha256 = ANY(%s)", (list(wanted),)).fetchall()
    have = {r[0] for r in rows}
    sent = size = 0
    for sha, b in wanted.items():
        if sha in have:
            continue
        cur.execute(
            "INSERT INTO fila_blobs (sha256, size, data) VALUES (%s, %s, %s) ON CONFLICT (sha256) DO NOTHING",
            (sha, len(b.data), b.data),
        )
        sent, size = sent + 1, size + len(b.data)
    return sent, size


def read(conn: Any, sha256: str) -> bytes | None:
    """The bytes stored under `sha256`, checked; None when there is none; BlobMismatch when what
    the database returns does not hash to its name."""
    row = conn.execute("SELECT data FROM fila_blobs WHERE sha256 = %s", (sha256,)).fetchone()
    if row is None:
        return None
    data = bytes(row[0])
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise BlobMismatch(
            f"the blob stored as sha256 {sha256} hashes to {actual}: the database holds other bytes "
            "under its name",
            hint="the queue database was changed outside fila; restore it from a backup",
        )
    return data
