"""What the pages of `fila serve` show, as plain data for the templates and the JSON endpoints:
the queue's list (filtered, ordered, paged), a task's review and its diff by file.

Every string here that a task's author or an engine chose is made inert first (core/text.inert,
the escaping the terminal and REVIEW.html use: control, bidi and zero-width characters shown as
\\x1b, \\u202e); the templates then escape it for HTML (Jinja's autoescape), and the page's script
only ever sets text, never markup (docs/review-web.md).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.errors import FilaError
from ..core.layout import Root
from ..core.models import Record, Status
from ..core.text import escape_name, inert
from ..egress import record as egress
from ..review import desk, groups, report
from ..review.decision import DECIDABLE
from ..run.check import check_log

if TYPE_CHECKING:
    from ..queue.pg.store import PgQueue

# needs_review first: what waits for a person, then what may (a failure a person retries or
# rejects), then what runs, then what is decided.
ORDER = [
    Status.needs_review,
    Status.needs_human,
    Status.failed,
    Status.running,
    Status.queued,
    Status.applied,
    Status.rejected,
]
PER_PAGE = 50
# What a task's page renders of its diff (docs/review-web.md, "A task"): beyond these, the rest is
# counted and left to `fila diff`; a patch under max_diff_bytes can still be tens of MB.
MAX_FILE_ROWS = 2000
MAX_ROWS = 20_000
MAX_LINE_CHARS = 2000
MAX_TEXT_CHARS = 2 << 20
DIFF_CACHE = 8  # patches kept rendered, by sha256
PROMPT_SHOWN = 160
FILTERS = ("status", "engine", "policy", "group", "q")


@dataclass
class Query:
    """The list's filters and page, parsed from a request's query string (docs/review-web.md)."""

    status: Status | None = None
    engine: str = ""
    policy: str = ""
    group: str = ""
    q: str = ""
    page: int = 1

    def matches(self, rec: Record) -> bool:
        task = rec.task
        if self.status is not None and rec.status != self.status:
            return False
        if self.engine and (rec.engine or (task.engine if task else "")) != self.engine:
            return False
        if self.policy and (rec.policy.name if rec.policy else (task.policy if task else "")) != self.policy:
            return False
        if self.group and (task.group if task else None) != self.group:
            return False
        return not self.q or (task is not None and self.q.casefold() in task.prompt.casefold())

    def params(self) -> dict[str, str]:
        """The filters as query parameters (the page's links keep them)."""
        out = {k: str(getattr(self, k)) for k in ("engine", "policy", "group", "q") if getattr(self, k)}
        if self.status is not None:
            out["status"] = self.status.value
        return out


@dataclass
class Listing:
    counts: dict[str, int]
    total: int
    page: int
    pages: int
    rows: list[dict[str, Any]]
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    policies: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "counts": self.counts,
            "total": self.total,
            "page": self.page,
            "pages": self.pages,
            "rows": self.rows,
            "unreadable": [list(x) for x in self.unreadable],
        }


def row(rec: Record) -> dict[str, Any]:
    """One task in the list: each field inert."""
    task = rec.task
    prompt = inert(task.prompt if task else "")
    s = rec.diffstat
    return {
        "id": inert(rec.id),
        "status": rec.status.value,
        "engine": inert(rec.engine or (task.engine if task else "") or "-"),
        "policy": inert(rec.policy.name if rec.policy else (task.policy if task else "-")),
        "group": inert(task.group) if task and task.group else "",
        "submitted_at": inert(rec.submitted_at),
        "prompt": prompt[:PROMPT_SHOWN] + ("…" if len(prompt) > PROMPT_SHOWN else ""),
        "diff": f"{s.files} files, +{s.insertions} -{s.deletions}" if s else "",
        "error": rec.error.kind.value if rec.error else "",
        "decision": f"{rec.decision.action} by {inert(rec.decision.by)}" if rec.decision else "",
    }


class Lister:
    """The queue's records, read again only when they may have changed: for the file queue when
    fila/out or fila/in changed (a record is written by a rename into fila/out, which changes the
    directory), and then only the records that changed are parsed; for a PostgreSQL queue at most
    once a second. Many pages polling read the queue once."""

    def __init__(self, root: Root, db: PgQueue | None) -> None:
        self.root, self.db = root, db
        self._lock = threading.Lock()
        self._key: object = None
        self._got: tuple[list[Record], list[str], list[tuple[str, str]]] = ([], [], [])
        self._parsed: dict[str, Any] = {}  # the file queue's records by file (queue/records.all_records)

    def _stamp(self) -> object:
        if self.db is not None:
            return int(time.monotonic())
        return tuple(os.stat(d).st_mtime_ns for d in (self.root.out_dir, self.root.in_dir))

    def records(self) -> tuple[list[Record], list[str], list[tuple[str, str]]]:
        with self._lock:
            key = self._stamp()
            if key != self._key:
                self._got, self._key = desk.listing(self.root, self.db, cache=self._parsed), key
            return self._got

    def warm(self) -> None:
        """The first read, ahead of the first request; a failure is left for that request to say."""
        with contextlib.suppress(FilaError, OSError, ValueError):
            self.records()

    def page(self, query: Query, per_page: int = PER_PAGE) -> Listing:
        recs, dropped, unreadable = self.records()
        counts = {s.value: 0 for s in ORDER}
        for r in recs:
            counts[r.status.value] += 1
        counts[Status.queued.value] += len(dropped)
        rank = {s: i for i, s in enumerate(ORDER)}
        chosen = sorted(
            (r for r in recs if query.matches(r)), key=lambda r: (rank[r.status], r.submitted_at, r.id)
        )
        pages = max(1, -(-len(chosen) // per_page))
        page = min(max(1, query.page), pages)
        shown = chosen[(page - 1) * per_page : page * per_page]
        return Listing(
            counts=counts,
            total=len(chosen),
            page=page,
            pages=pages,
            rows=[row(r) for r in shown],
            unreadable=[(inert(i), inert(why)) for i, why in unreadable],
            engines=sorted({inert(r.engine) for r in recs if r.engine}),
            policies=sorted({inert(r.policy.name) for r in recs if r.policy}),
            groups=sorted({inert(r.task.group) for r in recs if r.task and r.task.group}),
        )


def summary(rv: report.Review) -> list[tuple[str, str]]:
    """The review's summary as (label, value) pairs: report.summary_lines, already inert, and the
    egress section (egress/record.lines)."""
    out = []
    for line in report.summary_lines(rv) + egress.lines(rv.record.egress):
        key, _, value = line.partition(" ")
        out.append((key, value.strip()))
    return out


def check(root: Root, db: PgQueue | None, rec: Record) -> dict[str, str] | None:
    """The check's command, result and (the file queue's) log's end, inert. The log is read at the
    name the check writes for this id (run/check.py, check_log), never at another path a record
    names."""
    c = rec.check
    if c is None:
        return None
    log = b"" if db is not None else report.file_tail(check_log(root, rec))
    how = "timed out" if c.timed_out else ("passed" if c.passed else "failed")
    return {
        "command": inert(c.command),
        "result": how
        + (f" (exit {c.exit_code})" if c.exit_code is not None else "")
        + (f" in {c.duration_s:g} s" if c.duration_s is not None else ""),
        "log_path": escape_name(c.log_path) if c.log_path else "",
        "log": log_text(log),
    }


@dataclass
class Shown:
    """A diff as a page renders it: each file's first rows within the caps, and how many rows were
    left out (per file and in all)."""

    files: list[report.FileDiff]
    left_out: list[int]
    total_left_out: int = 0
    long_lines: int = 0  # lines cut at MAX_LINE_CHARS


def capped(files: list[report.FileDiff]) -> Shown:
    """The files' rows within MAX_FILE_ROWS per file, MAX_ROWS and MAX_TEXT_CHARS in all, each
    line cut at MAX_LINE_CHARS; every file keeps its label."""
    out = Shown([], [])
    rows = chars = 0
    for f in files:
        kept: list[report.DiffRow] = []
        for r in f.rows:
            if len(kept) >= MAX_FILE_ROWS or rows >= MAX_ROWS or chars >= MAX_TEXT_CHARS:
                break
            if len(r.text) > MAX_LINE_CHARS:
                out.long_lines += 1
                more = len(r.text) - MAX_LINE_CHARS
                r = report.DiffRow(
                    r.kind, r.old, r.new, r.text[:MAX_LINE_CHARS] + f"… ({more} more characters)"
                )
            kept.append(r)
            rows, chars = rows + 1, chars + len(r.text)
        out.files.append(report.FileDiff(f.label, kept, f.name, f.kind))
        out.left_out.append(len(f.rows) - len(kept))
    out.total_left_out = sum(out.left_out)
    return out


class DiffCache:
    """The capped diffs of the last few patches, by the sha256 the review checked: a page opened
    again (or by many reviewers) parses its patch once."""

    def __init__(self, size: int = DIFF_CACHE) -> None:
        self._lock = threading.Lock()
        self._by_sha: OrderedDict[str, Shown] = OrderedDict()
        self.size = size

    def shown(self, rv: report.Review) -> Shown:
        key = rv.record.patch_sha256
        with self._lock:
            got = self._by_sha.get(key) if key else None
            if got is not None:
                self._by_sha.move_to_end(key)
                return got
        got = capped(report.diff_files(rv)) if rv.data else Shown([], [])
        if key:
            with self._lock:
                self._by_sha[key] = got
                while len(self._by_sha) > self.size:
                    self._by_sha.popitem(last=False)
        return got


def split(rows: list[report.DiffRow]) -> list[tuple[report.DiffRow | None, report.DiffRow | None]]:
    """A file's rows side by side: context on both sides, a run of deletions beside the run of
    additions that follows it, everything else across the whole width (left only)."""
    out: list[tuple[report.DiffRow | None, report.DiffRow | None]] = []
    dels: list[report.DiffRow] = []
    adds: list[report.DiffRow] = []

    def flush() -> None:
        for i in range(max(len(dels), len(adds))):
            out.append((dels[i] if i < len(dels) else None, adds[i] if i < len(adds) else None))
        dels.clear()
        adds.clear()

    for r in rows:
        if r.kind == "del":
            if adds:
                flush()
            dels.append(r)
        elif r.kind == "add":
            adds.append(r)
        else:
            flush()
            out.append((r, r))
    flush()
    return out


def decidable(rec: Record) -> dict[str, bool]:
    """Which decisions the task's status allows (the same table the decision checks)."""
    return {
        "apply": rec.status in DECIDABLE["apply"],
        "reject": rec.status in DECIDABLE["reject"],
        "retry": rec.status in (Status.failed, Status.needs_human),
    }


def task_state(rec: Record) -> dict[str, Any]:
    """What a task's page follows while it is open (the JSON its script polls)."""
    d = rec.decision
    return {
        "id": inert(rec.id),
        "status": rec.status.value,
        "decision": f"{d.action} by {inert(d.by)} at {inert(d.at)}"
        + (f": {inert(d.reason)}" if d.reason else "")
        if d
        else "",
        "decidable": decidable(rec),
    }


def log_text(data: bytes) -> str:
    """Log bytes as inert text, line by line (what `fila logs` shows on a terminal)."""
    return "\n".join(inert(x) for x in data.split(b"\n"))


def comparison(c: groups.Comparison) -> dict[str, Any]:
    """A compare group's table (review/groups.COLUMNS, what `fila compare` prints), each cell
    inert, and each member's files, error, check and decision."""
    return {
        "group": inert(c.group),
        "targets": inert(", ".join(c.targets)),
        "prompt": inert(c.prompt or ""),
        "columns": [name for name, _f in groups.COLUMNS],
        "rows": [
            {
                "id": inert(r.id),
                "cells": [inert(f(r)) for _name, f in groups.COLUMNS],
                "files": [escape_name(p) for p in r.files],
                "notes": [
                    inert(f"{k}: {v}")
                    for k, v in (("error", r.error), ("check", r.check), ("decision", r.decision))
                    if v
                ],
            }
            for r in c.rows
        ],
    }
