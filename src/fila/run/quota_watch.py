"""Falling back promptly (docs/engines.md, "Falling back promptly"): while an engine runs with a
fallback engine waiting, the host reads the job's gateway log as it grows, and the first quota answer
an upstream gives on one of the engine's model routes ends the attempt (`StopRun`, from the run's
heartbeat). The engine's own retries would only spend minutes before the same verdict. Without a
fallback nothing watches: the engine's retries stand.

The gateway writes egress.jsonl line-buffered (images/gateway/fila_gateway.py), one final line per
route call with the upstream's status. A 429 the gateway itself answers (the job's egress budget) is
not the upstream's (`allowed` false, `budget` set) and never stops the run: every engine of the chain
shares that budget.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Collection
from pathlib import Path

from ..sandbox.base import StopRun

# An upstream's quota answer: every vendor's rate limit and used-up quota come as HTTP 429.
QUOTA_STATUSES = frozenset({429})
READ_CAP = 1 << 20  # bytes read per heartbeat at most: the rest waits for the next one
TOTAL_CAP = 8 << 20  # the gateway's own log cap and then some: past it, nothing more is read
# The engine's grace once stopped: its work/ is discarded (the fallback gets a fresh copy), so only
# its last words are waited for (gemini-cli ignores SIGTERM: the policy's grace would be lost).
STOP_GRACE_MS = 1000


def gateway_log(egress_dir: Path) -> Path:
    """egress.jsonl in the job's gateway directory (RunSpec.egress_dir), as egress.config.collect
    reads it after the run."""
    return egress_dir / "log" / "egress.jsonl"


class QuotaWatch:
    """The quota answers of one run's gateway log, read from where the last call stopped."""

    def __init__(self, log: Path, routes: Collection[str], then: str) -> None:
        self.log = log
        self.routes = frozenset(routes)
        self.then = then  # the engine that runs next, named in the reason
        self.offset = 0
        self.partial = b""
        self.found: str | None = None

    def poll(self) -> str | None:
        """The reason to stop when a quota answer is in the log by now, else None."""
        if self.found is None and self.offset < TOTAL_CAP:
            for raw in self._new_lines():
                self.found = self._quota(raw)
                if self.found is not None:
                    break
        return self.found

    def check(self) -> None:
        """For the run's heartbeat: raise StopRun once a quota answer is in the log."""
        why = self.poll()
        if why is not None:
            raise StopRun(why, grace_ms=STOP_GRACE_MS)

    def _new_lines(self) -> list[bytes]:
        # A link or a fifo in place of the log is not the gateway's: the watch gives up (the run
        # goes on, with the engine's own retries), and the record's egress section, read after the
        # run as carefully, says the log was unusable.
        try:
            fd = os.open(self.log, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTDIR):  # else not written yet
                self.offset = TOTAL_CAP
            return []
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                self.offset = TOTAL_CAP
                return []
            if st.st_size < self.offset:  # a new log (a new gateway): from its start
                self.offset, self.partial = 0, b""
            f.seek(self.offset)
            data = f.read(READ_CAP)
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()  # a line still being written ends in the next read
        if len(self.partial) > READ_CAP:  # no line of the gateway's is this long
            self.partial = b""
        return lines

    def _quota(self, raw: bytes) -> str | None:
        try:
            line = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(line, dict):
            return None
        status, route = line.get("status"), line.get("route")
        if (
            line.get("door") == "route"
            and line.get("allowed") is True
            and not line.get("budget")
            and isinstance(status, int)
            and status in QUOTA_STATUSES
            and isinstance(route, str)
            and route in self.routes
        ):
            return (
                f"cut short for the fallback to {self.then}: the model route {route} answered "
                f"HTTP {status} (gateway log)"
            )
        return None
