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
