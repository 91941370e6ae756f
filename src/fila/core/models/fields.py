"""The field types the task, policy and record formats share (docs/architecture.md, `core/`):
sizes and their parsing, counts, milliseconds, timestamps, and the floors and ceilings every
resource a policy grants or a task narrows stays within. The formats' modules take their fields
from here, so one floor holds for a policy and for the task that narrows it."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator, Field

SIZE_PATTERN = r"^[0-9]+[kmgKMG]?$"
_SIZE_RE = re.compile(SIZE_PATTERN)


def parse_size(value: str) -> int:
    """'512m' -> bytes. Sizes are Docker's: k, m, g are powers of 1024."""
    if not _SIZE_RE.fullmatch(value):
        raise ValueError(f"not a size: {value!r} (use e.g. 512m or 2g)")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    unit = value[-1].lower()
    if unit in units:
        return int(value[:-1]) * units[unit]
    return int(value)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


Size = Annotated[str, Field(pattern=SIZE_PATTERN, description="bytes, or a number with k, m or g")]

# Floors and ceilings of every resource a policy grants or a task narrows.
# Docker reads 0 (and an empty value) as "no limit" or "the daemon's default" for memory, cpus,
# pids and tmpfs sizes, and an overflowing size wraps; so no value below a floor that still runs
# something, or above a ceiling that fits every kernel interface, is ever accepted. A task's
# narrowing meets the same floors as the policy it narrows.
MiB = 1 << 20
MIN_MEMORY = 6 * MiB  # Docker's own floor ("Minimum memory limit allowed is 6MB")
MIN_SIZE = 1 * MiB  # tmpfs and fsize: 0 is "unlimited" for a tmpfs, and nothing can be written below this
MAX_SIZE = 1 << 40  # 1 TiB: far above any sandbox, far below int64 overflow
MIN_CPUS = 0.01  # Docker's floor; nano_cpus >= 10_000_000, never rounded to 0
MAX_CPUS = 1024.0
MIN_PIDS = 4  # docker-init, sh, one command and a child: fewer runs nothing
MAX_PIDS = 4_194_304  # the kernel's PID_MAX_LIMIT
MIN_NOFILE = 16
MAX_NOFILE = 1_048_576  # the kernel's default nr_open: a higher hard limit fails at start
MAX_TIMEOUT_MS = 30 * 24 * 3600 * 1000  # 30 days: timeouts and grace are fila's, not Docker's
MAX_COUNT = 1 << 40  # byte and entry caps fila enforces itself (max_*_bytes, max_work_files)


def _size_within(minimum: int, maximum: int = MAX_SIZE) -> AfterValidator:
    """A size that parses to bytes within [minimum, maximum]: "0", "0k" and "9999999999999g" fail."""

    def check(value: str) -> str:
        n = parse_size(value)
        if not minimum <= n <= maximum:
            raise ValueError(f"{value!r} is {n} bytes: allowed {minimum // MiB}m to {maximum // (1 << 30)}g")
        return value

    return AfterValidator(check)


MemorySize = Annotated[
    str,
    Field(pattern=SIZE_PATTERN, description="bytes, or a number with k, m or g; at least 6m, at most 1024g"),
    _size_within(MIN_MEMORY),
]
LimitSize = Annotated[
    str,
    Field(pattern=SIZE_PATTERN, description="bytes, or a number with k, m or g; at least 1m, at most 1024g"),
    _size_within(MIN_SIZE),
]
Cpus = Annotated[float, Field(strict=True, ge=MIN_CPUS, le=MAX_CPUS, allow_inf_nan=False)]
Pids = Annotated[int, Field(strict=True, ge=MIN_PIDS, le=MAX_PIDS)]
Millis = Annotated[int, Field(strict=True, gt=0, le=MAX_TIMEOUT_MS)]
# A task's own timeout: below a second no engine even starts, so a shorter one only makes a
# failure on purpose (1 ms tasks would trip the breaker).
MIN_TASK_TIMEOUT_MS = 1000
TaskMillis = Annotated[int, Field(strict=True, ge=MIN_TASK_TIMEOUT_MS, le=MAX_TIMEOUT_MS)]
Count = Annotated[int, Field(strict=True, gt=0, le=MAX_COUNT)]
