"""Where the file queue keeps a task's statements (docs/provenance.md, "Where they are"):
`fila/provenance/<id>.run.json` and `<id>.decision.json` under the root, each a DSSE envelope.
A PostgreSQL queue keeps them as the task's blobs of the same names (queue/pg/keys.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Literal

from ..core import fsutil
from ..core.layout import Root, check_id

Kind = Literal["run", "decision"]
KINDS: tuple[Kind, ...] = ("run", "decision")


def blob_name(kind: Kind) -> str:
    """The name of the statement's file, and of its blob on a PostgreSQL queue."""
    return f"provenance.{kind}.json"


def path(root: Root, task_id: str, kind: Kind) -> Path:
    return root.fila / "provenance" / f"{check_id(task_id)}.{kind}.json"


def write(root: Root, task_id: str, kind: Kind, data: bytes) -> Path:
    p = path(root, task_id, kind)
    p.parent.mkdir(exist_ok=True)
    fsutil.atomic_write(p, data)
    return p


def read(root: Root, task_id: str, kind: Kind) -> bytes | None:
    with contextlib.suppress(FileNotFoundError):
        return path(root, task_id, kind).read_bytes()
    return None


def export(dest: Path, task_id: str, *, patch: bytes | None, run: bytes | None, decision: bytes | None,
           public_keys: dict[str, bytes]) -> list[Path]:  # fmt: skip
    """What `fila verify --patch --attestation --key` reads, written to `dest` (made when
    missing): DIFF.patch, `<id>.run.json`, `<id>.decision.json` and each signer's public key as
    `<keyid>.pub.json`; the paths written."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    files = {
        "DIFF.patch": patch,
        f"{check_id(task_id)}.run.json": run,
        f"{check_id(task_id)}.decision.json": decision,
        **{f"{keyid}.pub.json": data for keyid, data in public_keys.items()},
    }
    for name, data in files.items():
        if data is not None:
            fsutil.atomic_write(dest / name, data)
            written.append(dest / name)
    return written
