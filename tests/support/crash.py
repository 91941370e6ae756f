"""Crash points: where each leaves a task once recovery has run, and the invariant that every
task is in exactly one state."""

from __future__ import annotations

from fila.core.layout import Root
from fila.core.models import Status
from fila.queue import store as queue

S = Status

# Where each crash point leaves the task once recovery has run.
EXPECTED = {
    "after_claim": S.queued,
    "after_begin": S.queued,
    "after_job_dir": S.queued,
    "after_checkpoint": S.needs_human,
    "after_container_start": S.needs_human,
    "during_run": S.needs_human,
    "after_exit": S.needs_human,
    # The container exited and its removal, in the background while the host diffs work/, has not
    # happened: recovery finds it by its labels, removes it (and its work volume), needs_human.
    "during_removal": S.needs_human,
    "after_diff": S.needs_human,
    "after_result": S.needs_human,
    "after_win": S.needs_review,
    "during_record_write": S.needs_review,
    "after_record": S.needs_review,
}


def assert_one_state_each(root: Root, ids: list[str]) -> dict[str, Status]:
    """Exactly one place per task; no claim or tombstone left after recovery."""
    out = {}
    for tid in ids:
        rec = queue.get_record(root, tid)
        claims = queue.claim_files(root, tid)
        in_file = root.queued_path(tid).exists()
        assert not claims, f"{tid}: {[p.name for p in claims]} left in fila/run/"
        assert in_file == (rec.status == S.queued), f"{tid}: {rec.status}, in/ file {in_file}"
        assert queue.field_problem(rec) is None
        out[tid] = rec.status
    assert not list(root.out_dir.glob(".*.tmp"))
    return out
