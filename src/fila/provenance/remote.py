"""A PostgreSQL queue's side of what verification reads (docs/provenance.md, "Where they are"):
imported only with a queue URL, so the file queue never loads psycopg."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..queue.pg.blobs import Blob
from ..queue.pg.store import INPUTS, PgQueue
from . import store
from .store import Kind

if TYPE_CHECKING:
    from .keys import TrustedKey


class QueueSource:
    """A PostgreSQL queue: the task's blobs, fila_trusted_keys, the input manifest's blob."""

    def __init__(self, db: PgQueue) -> None:
        self.db = db
        self.where = f"the queue database {db.where}"

    def statement(self, task_id: str, kind: Kind) -> bytes | None:
        return self.db.named_blob(task_id, store.blob_name(kind))

    def attest(self, task_id: str, kind: Kind, data: bytes) -> None:
        blob = Blob.of(store.blob_name(kind), data)
        self.db.attach(task_id, blob, event=f"{kind} statement signed", data={})

    def trusted(self) -> list[TrustedKey]:
        from . import keys

        return keys.from_rows(self.db.trusted_rows(), where=self.db.where)

    def inputs(self, task_id: str) -> bytes | None:
        return self.db.named_blob(task_id, INPUTS)
