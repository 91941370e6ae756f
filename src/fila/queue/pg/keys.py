"""A PostgreSQL queue's side of provenance (docs/provenance.md): the trusted public keys
(`fila_trusted_keys`) and a task's statements, stored as its blobs `provenance.run.json` (the
runner publishes it with the record) and `provenance.decision.json` (added after the decision).
The rows are read as untrusted: a key's id is computed again by the reader (provenance/keys.py)."""

from __future__ import annotations

from typing import Any

from ...core.errors import NotFound
from . import blobs as blobstore
from .blobs import Blob
from .db import Database


class PgKeys(Database):
    """The trusted keys and the statements' blobs."""

    def trusted_rows(self) -> list[tuple[str, str, str, str]]:
        """(keyid, name, the key as JSON text, added_at) of every trusted key, oldest first."""
        return self._tx(
            lambda conn, _again: conn.execute(
                "SELECT keyid, name, key::text, added_at::text FROM fila_trusted_keys "
                "ORDER BY added_at, keyid"
            ).fetchall()
        )

    def trust_key(self, keyid: str, name: str, key: dict[str, Any], *, by: str) -> bool:
        """Trust `key` (its keyid computed by the caller); False when it was trusted already."""
        from psycopg.types.json import Jsonb

        row = self._tx(
            lambda conn, _again: conn.execute(
                "INSERT INTO fila_trusted_keys (keyid, name, key, added_by) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (keyid) DO NOTHING RETURNING keyid",
                (keyid, name, Jsonb(key), by),
            ).fetchone()
        )
        return row is not None

    def attach(self, task_id: str, blob: Blob, *, event: str, data: dict[str, Any]) -> None:
        """Name `blob` among the task's blobs (a decision's statement, after the decision), with
        an event; the blob's sha256 is checked first."""
        blobstore.check(blob, task_id=task_id)

        def run(conn: Any, _again: bool) -> None:
            sql = "SELECT attempt FROM fila_tasks WHERE id = %s FOR UPDATE"
            row = conn.execute(sql, (task_id,)).fetchone()
            if row is None:
                raise NotFound(f"no task {task_id!r} in the queue database {self.where}")
            blobstore.put_missing(conn, [blob])
            conn.execute(
                "INSERT INTO fila_task_blobs (task_id, name, sha256, attempt) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (task_id, name) DO UPDATE SET sha256 = excluded.sha256",
                (task_id, blob.name, blob.sha256, row[0]),
            )
            self._event(conn, task_id, event, {**data, "blob": blob.name, "sha256": blob.sha256})

        self._tx(run)

    def named_blob(self, task_id: str, name: str) -> bytes | None:
        """The task's blob `name`, checked; None when the task names none."""
        sha = self.task_blobs(task_id).get(name)
        return self.blob(sha) if sha is not None else None
