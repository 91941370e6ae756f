"""Task statuses, error kinds and ids: what the CLI needs at start-up, without pydantic."""

from __future__ import annotations

import re
from enum import StrEnum

ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
_ID_RE = re.compile(ID_PATTERN)


def valid_id(value: str) -> bool:
    # "." and ".." match the character class but are path tricks. fullmatch: with re.match, `$`
    # also matches before a trailing newline, and "x\n" would pass as an id.
    return bool(_ID_RE.fullmatch(value)) and value not in {".", ".."}


class Status(StrEnum):
    queued = "queued"
    running = "running"
    needs_review = "needs_review"
    failed = "failed"
    needs_human = "needs_human"
    applied = "applied"
    rejected = "rejected"


class ErrorKind(StrEnum):
    timeout = "timeout"
    engine_error = "engine_error"
    infra = "infra"
    invalid = "invalid"
    quota = "quota"
    auth = "auth"
    interrupted = "interrupted"
    environment = "environment"
