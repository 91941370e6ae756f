"""The one retry policy (queue/retry.py): a task's infrastructure errors and the worker's probe of
an unreachable daemon, the attempts and backoff caps each allows."""

from __future__ import annotations

from fila.core.errors import EngineUnavailable, ImageMissing, InfraError, InvalidTaskFile
from fila.core.models import Attempt, Record, Status
from fila.queue import retry
from fila.run.worker import DAEMON_PROBE


def test_a_task_gets_five_attempts_and_backs_off_at_most_a_minute_with_full_jitter() -> None:
    p = retry.INFRA
    assert (p.attempts, p.base, p.cap, p.jitter) == (5, 1.0, 60.0, True)
    assert [p.gives_up(n) for n in range(1, 7)] == [False, False, False, False, True, True]
    for n, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (7, 60.0), (40, 60.0)]:
        waits = [p.backoff(n) for _ in range(200)]
        assert all(0 <= w <= ceiling for w in waits), n
        assert len(set(waits)) > 1, "jittered"


def test_the_daemon_probe_doubles_to_half_a_minute_and_never_gives_up() -> None:
    assert [DAEMON_PROBE.backoff(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert not DAEMON_PROBE.gives_up(10**6)


def test_infrastructure_errors_are_transient_unless_the_engine_refused_the_request() -> None:
    for err in (InfraError("down"), EngineUnavailable("no daemon"), ImageMissing("not built")):
        assert retry.INFRA.transient(err)
        assert not retry.INFRA.transient(err, refused=True)
    assert not retry.INFRA.transient(InvalidTaskFile("bad"))
    assert not retry.INFRA.transient(OSError("disk"))


def test_only_infrastructure_errors_and_lost_workers_count_toward_the_attempts() -> None:
    outcomes = ["requeued", "lost", "handed back", "failed", "requeued"]
    rec = Record(
        id="t1",
        status=Status.queued,
        attempts=[Attempt(number=i + 1, engine="shell", outcome=o) for i, o in enumerate(outcomes)],
    )
    assert retry.INFRA.tries(rec) == 3
    assert retry.INFRA.tries(None) == 0
