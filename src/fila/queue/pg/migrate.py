"""The queue's schema: numbered SQL files applied in order, each in one transaction with its row
in `fila_schema` (docs/architecture.md, "The PostgreSQL queue").

`migrations/NNNN_name.sql` ships inside the package. `migrate(url)` creates the schema or applies
what is missing, under a transaction-scoped advisory lock so that two runners starting together
apply each file once; a database whose schema is newer than this fila knows is refused (the newer
fila that wrote it must run against it, or this one be upgraded), never downgraded or touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from . import conninfo
from .errors import SchemaMismatch

# pg_advisory_xact_lock key: "fila" in ASCII. Held for one migration's transaction.
LOCK_KEY = 0x66696C61
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
VERSION_TABLE = """CREATE TABLE IF NOT EXISTS fila_schema (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """The shipped migrations, in order; numbered 1, 2, ... without a gap (checked)."""
    found = []
    for entry in resources.files(__package__).joinpath("migrations").iterdir():
        m = _NAME.match(entry.name)
        if m:
            found.append(Migration(int(m[1]), m[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda x: x.version)
    if [x.version for x in found] != list(range(1, len(found) + 1)):
        raise AssertionError(f"the shipped migrations are not numbered 1..n: {[x.version for x in found]}")
    return found


def latest() -> int:
    """The schema version this fila knows."""
    return len(migrations())


def current_version(conn: Any) -> int:
    """The database's schema version (0: no fila schema), read on `conn`."""
    row = conn.execute("SELECT to_regclass('fila_schema') IS NOT NULL").fetchone()
    if not row[0]:
        return 0
    return int(conn.execute("SELECT coalesce(max(version), 0) FROM fila_schema").fetchone()[0])


def too_new(found: int, where: str) -> SchemaMismatch:
    return SchemaMismatch(
        f"the queue database {where} has schema version {found}; this fila knows versions up to {latest()}",
        hint="upgrade fila on this host to the version that migrated the database; "
        "fila never downgrades a schema",
    )


def migrate(url: str) -> tuple[int, int]:
    """Create or upgrade the schema at `url`: (the version this call found before it applied
    anything, the version after). Applying twice is a no-op, and so is a call that another
    process beat to it; a newer schema raises SchemaMismatch and changes nothing."""
    params = conninfo.parse(url)
    where = conninfo.describe(params)
    known = migrations()
    before: int | None = None
    with conninfo.connect(url, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            conn.execute(VERSION_TABLE)
        for mig in known:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
                have = current_version(conn)  # another process may have applied it meanwhile
                if have > len(known):
                    raise too_new(have, where)
                if have >= mig.version:
                    continue
                before = have if before is None else before
                conn.execute(mig.sql)
                conn.execute(
                    "INSERT INTO fila_schema (version, name) VALUES (%s, %s)", (mig.version, mig.name)
                )
        after = current_version(conn)
        if after > len(known):
            raise too_new(after, where)
        return (after if before is None else before), after


def check(conn: Any, where: str) -> int:
    """The version of the schema on `conn` when it is the one this fila knows; SchemaMismatch
    otherwise (older: not migrated yet; newer: this fila is too old)."""
    have = current_version(conn)
    if have > latest():
        raise too_new(have, where)
    if have < latest():
        raise SchemaMismatch(
            f"the queue database {where} has schema version {have}; this fila needs {latest()}",
            hint="run `fila queue init --queue URL` to create or upgrade it",
        )
    return have
