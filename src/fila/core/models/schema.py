"""The formats' JSON Schemas: generated from the models (`fila schema task|policy|record`), and
stored once in `_schemas.json` beside this module so that a process validating a task or a policy
does not generate them (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .policy import Policy
from .record import Record
from .task import Task


def schema_for(name: str) -> dict[str, Any]:
    models: dict[str, type[BaseModel]] = {"task": Task, "policy": Policy, "record": Record}
    return models[name].model_json_schema()


# The schemas generated once and stored beside the code (`_schemas.json`, written by
# `python -m fila.entry --write`): generating them costs 10-20 ms a format in every process that
# validates a task or a policy (every submit, every worker's first claim). They are used only while
# the sources they came from are these (every module of this package, core/states.py and
# pydantic's version), so an edited model is validated against its own schema, generated, until
# the file is written again; and only while the file is owned like this module and not
# group/other-writable (stored.stored_bytes): its key is computed from public sources, so anyone
# who could write it could choose what is accepted.
_STORED = Path(__file__).with_name("_schemas.json")


def _schema_key() -> str:
    import hashlib

    import pydantic

    here = Path(__file__).parent
    h = hashlib.sha256(pydantic.VERSION.encode())
    # Every module of the package, by name and content: a module added to it counts without a list
    # to keep.
    for source in [*sorted(here.glob("*.py")), here.parent / "states.py"]:
        h.update(f"\0{source.name}\0".encode())
        h.update(source.read_bytes())
    return h.hexdigest()


def published_schema(name: str) -> dict[str, Any]:
    """`schema_for(name)`, read from `_schemas.json` when that was generated from these sources
    and is owned like this module."""
    from ..stored import stored_bytes

    raw = stored_bytes(str(_STORED), __file__)  # None: missing, unreadable or not to be trusted
    try:
        stored = json.loads(raw) if raw is not None else None
        if stored is not None and stored["key"] == _schema_key():
            return dict(stored["schemas"][name])
    except (OSError, ValueError, KeyError, TypeError):  # another layout
        pass
    return schema_for(name)


def write_stored_schemas() -> Path:
    schemas = {name: schema_for(name) for name in ("task", "policy", "record")}
    from ..fsutil import atomic_write

    # 0644 whatever the umask: a group-writable copy would be ignored (published_schema).
    atomic_write(_STORED, json.dumps({"key": _schema_key(), "schemas": schemas}, indent=1) + "\n", mode=0o644)
    return _STORED
