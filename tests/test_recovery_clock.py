"""A clock that went back: `run --once` (the real worker, the real daemon) never waits beyond the
backoff cap for a `not_before` further ahead than any backoff lasts; its recovery clamps it."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import datetime

import pytest

from fila.core import fsutil
from fila.core.layout import Root
from fila.core.models import Status
from fila.queue import retry
from fila.queue import store as queue
from fila.run import intake
from tests.support.project import shell_task

S = Status
pytestmark = pytest.mark.docker


def backoff_until(root: Root, tid: str, at: float) -> None:
    rec = queue.get_record(root, tid)
    fsutil.atomic_write(root.record_path(tid), rec.model_copy(update={"not_before": at}).to_json())


def recovered(root: Root, tid: str) -> list[str]:
    return [e["action"] for e in queue.read_events(root, tid) if e["event"] == "recovered"]


def test_run_once_waits_out_a_backoff_within_the_cap_and_never_one_a_clock_stepped_back_made(
    proj: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.run.worker import Worker

    # A short cap, so that waiting it out is quick; the hour below is what a clock stepped back
    # an hour after the backoff was written leaves in the record.
    monkeypatch.setattr(retry, "INFRA", dataclasses.replace(retry.INFRA, cap=2.0))
    intake.submit(proj, shell_task("echo a >> greeting.txt", id="t0"))
    intake.submit(proj, shell_task("echo b >> greeting.txt", id="t1"))
    start = time.time()
    backoff_until(proj, "t0", start + 1.0)  # a real backoff, within the cap: waited for
    backoff_until(proj, "t1", start + 3600)
    recs: list = []
    w = Worker(proj, once=True, on_record=recs.append)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    t.join(timeout=180)  # a bound far beyond the cap, far below the hour: never a timing
    if t.is_alive():
        w.request_stop(cancel=True, reason="the test's bound ran out")
        t.join(timeout=60)
        pytest.fail("run --once was still waiting for the hour-long backoff")
    assert sorted(r.id for r in recs) == ["t0", "t1"] and {r.status for r in recs} == {S.needs_review}
    assert recovered(proj, "t0") == [], "a backoff within the cap is the task's own"
    assert recovered(proj, "t1") == ["backoff clamped"]
    began = datetime.fromisoformat(queue.get_record(proj, "t0").attempts[-1].started_at or "").timestamp()
    assert began >= start + 1.0, "t0 ran once its backoff was over"
