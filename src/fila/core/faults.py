"""Fault injection for crash-consistency tests: named crash points.

`FILA_CRASH_AT=after_claim` (a comma-separated list of names) makes the process SIGKILL itself
when it reaches that point of the cycle, exactly as a power cut or the OOM killer would: no
`finally`, no `atexit`, no buffered write flushed. The tests then run recovery and check that every
task is in exactly one state. It is a fault-injection hook, not a test mode: nothing else in fila
behaves differently when it is set, and with the variable unset each point costs one dict lookup.

`FILA_CRASH_AT=after_checkpoint:stop` SIGSTOPs the process at that point instead: a frozen worker
(a zombie) that a test can let the lease expire on, then resume with SIGCONT to check that every
write and every side effect it attempts afterwards is fenced off. A test that stops a process must
SIGKILL it in a `finally`.

The points, in the order a task meets them (run/job.py, run/attempts.py, run/claimed.py,
queue/store.py; the last two are apply's, in review/apply.py and review/landing.py, and are not in
POINTS, the cycle's list that test_durability walks):
    after_claim            the task file was renamed into fila/run/, the record still says queued
    after_begin            the record says running (attempt + 1); no job directory yet
    after_job_dir          sandbox/jobs/<id>/ is prepared; no container yet
    after_checkpoint       container_started is durable, the container is created, not started
    after_container_start  the container runs (first heartbeat)
    during_run             the container has run for a while (a later heartbeat)
    after_exit             the container exited; its removal runs in the background; no diff yet
    during_removal         (in that background removal) the container exited and is not removed
    after_diff             DIFF.patch is written; the outcome is not published
    after_result           the pending result is in sandbox/meta/<id>/result.json
    after_win              the claim was renamed to .done: the worker won the race
    during_record_write    the new record is in a temp file, not yet renamed over the old one
    after_record           the final record is written; the .done tombstone is still there
    during_hand_back       the task file is back in fila/in/, the record still says running
    apply_after_write      apply wrote one more file into the project (each file); not recorded yet
    apply_before_record    apply is complete on disk; the `applied` record is not written yet
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = (
    "after_claim",
    "after_begin",
    "after_job_dir",
    "after_checkpoint",
    "after_container_start",
    "during_run",
    "after_exit",
    "during_removal",
    "after_diff",
    "after_result",
    "after_win",
    "during_record_write",
    "after_record",
    "during_hand_back",
)
ENV = "FILA_CRASH_AT"


def crash_point(name: str) -> None:
    """SIGKILL this process if `name` is listed in FILA_CRASH_AT; SIGSTOP it if `name:stop` is."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    for item in wanted.split(","):
        point, _, action = item.partition(":")
        if point == name:
            if action == "stop":
                # To this thread: it stops before it runs another instruction. A SIGSTOP sent to
                # the process may be taken by another thread, and this one runs on meanwhile.
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
            return
