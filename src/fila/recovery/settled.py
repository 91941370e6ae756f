"""What the last recovery passes found needing nothing, so a pass over a long history reads only
what changed since (docs/architecture.md, the queue's contract)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..core import fsutil
from ..core.layout import Root
from ..core.models import Status
from ..queue import retry
from ..queue import store as queue
from .base import Report

S = Status


class Settled:
    """What the last passes found needing nothing, so that a pass over a long history reads only
    what changed since (a stat pass and a read of each record's bytes, not a lock and a log read
    per task): per task id, the sha256 of the record's bytes, and its event log's inode, size,
    mtime_ns and ctime_ns, noted under the record lock when `settle_task` found the record and
    its files agreeing. Any write to the record changes its bytes; any write to the log, an
    append or an edit in place of the same size, sets its ctime, which no user can set back
    (mtime alone can be); so an unchanged entry means nothing since then has left anything in
    between to reconcile. The files around it (fila/in/,
    fila/run/) are looked at in every pass, against the status in the record's own bytes (which
    the digest binds), never a status the cache states.

    The file is only a hint, which whoever can write fila/state/ could forge: it is read with
    O_NOFOLLOW and ignored unless it is a regular file of fila's uid that no one else may write;
    an entry of any other shape is a miss; unreadable or lost, the next pass reads everything."""

    VERSION = 2
    _HEX = "0123456789abcdef"
    _STATUSES = frozenset(str(s) for s in S)

    def __init__(self, root: Root, entries: dict[str, list[Any]], *, changed: bool = False) -> None:
        self.entries = entries
        self.changed = changed  # True: what is on disk is not ours and is replaced
        self.out, self.logs = str(root.out_dir), str(root.logs_dir)

    @staticmethod
    def path(root: Root) -> Path:
        return root.state_dir / "recovery.settled.json"

    @classmethod
    def load(cls, root: Root, rep: Report) -> Settled:
        from ..core.stored import NotTrusted, owned_bytes

        try:
            data = json.loads(owned_bytes(str(cls.path(root)), os.geteuid()))
        except FileNotFoundError:
            return cls(root, {})
        except NotTrusted as e:
            return cls._ignored(root, rep, str(e))
        except (OSError, ValueError, RecursionError):
            return cls(root, {}, changed=True)
        if not (
            isinstance(data, dict) and data.get("v") == cls.VERSION and isinstance(data.get("entries"), dict)
        ):
            return cls(root, {}, changed=True)
        entries = {k: v for k, v in data["entries"].items() if queue.valid_id(k) and cls._well_formed(v)}
        return cls(root, entries, changed=len(entries) != len(data["entries"]))

    @classmethod
    def _ignored(cls, root: Root, rep: Report, why: str) -> Settled:
        rep.add(
            root,
            None,
            "cache ignored",
            f"{cls.path(root)}: {why}; this pass reads every record",
        )
        return cls(root, {}, changed=True)

    @classmethod
    def _well_formed(cls, e: Any) -> bool:
        """[64 hex digits, null | [inode, size, mtime_ns, ctime_ns]]."""
        if not (isinstance(e, list) and len(e) == 2):
            return False
        digest, log = e
        if not (isinstance(digest, str) and len(digest) == 64 and not digest.strip(cls._HEX)):
            return False
        return log is None or (
            isinstance(log, list) and len(log) == 4 and all(type(n) is int and n >= 0 for n in log)
        )

    def _seen(self, tid: str) -> tuple[list[Any], bytes] | None:
        """([sha256 of the record, the log's [inode, size, mtime_ns, ctime_ns] or None], the
        record's bytes), or None when the record cannot be read."""
        try:
            with open(f"{self.out}/{tid}.json", "rb") as f:
                data = f.read()
            log: list[int] | None = None
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(f"{self.logs}/{tid}.events.jsonl")
                log = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        except OSError:
            return None
        return [hashlib.sha256(data).hexdigest(), log], data

    def unchanged(self, tid: str, *, queued: bool, claimed: bool, now: float) -> bool:
        """True when the record and its log are as a pass left them agreeing, and the files
        around it still agree with the status its own bytes state: a final record has no file in
        fila/in/ (a second copy), a queued one has its file (or a claim) and no backoff beyond
        the cap, a running one its claim and no file. Anything else, or any doubt, is a miss."""
        hit = self.entries.get(tid)
        if hit is None:
            return False
        seen = self._seen(tid)
        if seen is None or seen[0] != hit:
            return False
        try:
            rec = json.loads(seen[1])
        except (ValueError, RecursionError):
            return False
        if not isinstance(rec, dict) or rec.get("id") != tid:
            return False
        status, not_before = rec.get("status"), rec.get("not_before")
        if status == S.queued:
            late = isinstance(not_before, (int, float)) and not_before > now + retry.INFRA.cap
            return (queued or claimed) and not late
        if status == S.running:
            return claimed and not queued
        return status in self._STATUSES and not queued

    def note(self, tid: str) -> None:
        """Under the record lock, after `settle_task` found nothing to do for it."""
        seen = self._seen(tid)
        if seen is not None:
            self.entries[tid] = seen[0]
            self.changed = True

    def forget(self, tid: str) -> None:
        if self.entries.pop(tid, None) is not None:
            self.changed = True

    def save(self, root: Root, records: set[str]) -> None:
        gone = set(self.entries) - records
        for tid in gone:
            del self.entries[tid]
        if not (self.changed or gone):
            return
        data = json.dumps({"v": self.VERSION, "entries": self.entries}, separators=(",", ":"))
        # fsutil's write: a temp file of an unpredictable name made with O_EXCL (a link planted
        # in fila/state/ is never written through), mode 0644, renamed over whatever is there.
        with contextlib.suppress(OSError):
            fsutil.atomic_write(self.path(root), data, mode=0o644)
