"""Where a queue keeps what verification reads (docs/provenance.md, "Where they are"): the
statements, the trusted keys and the input manifest, behind one `Source`: the file queue's here
(`FileSource`), a PostgreSQL queue's in provenance/remote.py (imported only with a queue URL)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

from ..core.layout import Root
from ..queue import store as queue
from . import store
from .store import Kind

if TYPE_CHECKING:
    from .keys import TrustedKey


class Source(Protocol):
    where: str

    def statement(self, task_id: str, kind: Kind) -> bytes | None: ...

    def attest(self, task_id: str, kind: Kind, data: bytes) -> None: ...

    def trusted(self) -> list[TrustedKey]: ...

    def inputs(self, task_id: str) -> bytes | None: ...


class FileSource:
    """The file queue under `root`: fila/provenance/, fila/keys/trusted.json, the job's manifest."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.where = f"the queue root {root.path}"

    def statement(self, task_id: str, kind: Kind) -> bytes | None:
        return store.read(self.root, task_id, kind)

    def attest(self, task_id: str, kind: Kind, data: bytes) -> None:
        p = store.write(self.root, task_id, kind, data)
        where = str(p.relative_to(self.root.path))
        queue.log_event(self.root, task_id, f"{kind} statement signed", path=where)

    def trusted(self) -> list[TrustedKey]:
        from . import keys  # securesystemslib: loaded by the commands that verify only

        return keys.trusted(self.root)

    def inputs(self, task_id: str) -> bytes | None:
        with contextlib.suppress(OSError):
            return (self.root.meta(task_id) / "manifest.json").read_bytes()
        return None
