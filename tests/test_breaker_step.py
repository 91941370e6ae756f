"""The circuit breaker's counting rules as one pure step (queue/breaker.step), the same for the
file queue's worker (breaker.record) and the PostgreSQL queue's publish (queue/pg/breaker.count);
docs/architecture.md, "The queue's contract". In memory: no root, no database."""

from __future__ import annotations

from fila.core.models import ErrorInfo, ErrorKind, Record, Status, Task
from fila.queue import breaker
from fila.queue.breaker import BreakerState

S = Status
TASK = Task(engine="codex", command="true", targets=["x"])


def rec(tid: str, status: Status, kind: ErrorKind | None = None) -> Record:
    error = ErrorInfo(kind=kind, message="m") if kind else None
    return Record(id=tid, status=status, task=TASK, error=error)


def test_failures_trip_at_the_threshold_given_once_and_a_success_resets_the_count() -> None:
    st = BreakerState()
    for i in range(2):  # below the threshold of 3: counted, still closed
        done = breaker.step(st, rec(f"f{i}", S.failed, ErrorKind.infra), threshold=3, by="h1", at="T1")
        assert (done.changed, done.tripped, done.state.open) == (True, False, False)
        st = done.state
    assert (st.consecutive, st.recent, st.threshold) == (2, ["f0", "f1"], 3)
    # What says nothing about the host changes nothing; a success resets, once.
    assert breaker.step(st, rec("i", S.failed, ErrorKind.invalid), threshold=3, by="h1", at="T1").state is st
    reset = breaker.step(st, rec("ok", S.needs_review), threshold=3, by="h1", at="T1")
    assert reset.changed and (reset.state.consecutive, reset.state.recent) == (0, [])
    assert not breaker.step(reset.state, rec("ok2", S.needs_review), threshold=3, by="h1", at="T1").changed
    assert st.consecutive == 2, "the state given is not changed"
    # The third failure in a row opens it, named by who and when; a fourth does not trip again.
    done = breaker.step(st, rec("f2", S.needs_human, ErrorKind.infra), threshold=3, by="h2", at="T2")
    assert done.tripped and done.state.open and (done.state.tripped_by, done.state.tripped_at) == ("h2", "T2")
    assert done.state.reason == (
        "3 consecutive tasks failed or need a person (max_consecutive_failures 3); last: f2"
    )
    assert breaker.trip_data(done.state) == {"consecutive": 3, "threshold": 3, "tasks": ["f0", "f1", "f2"]}
    again = breaker.step(done.state, rec("f3", S.failed, ErrorKind.infra), threshold=3, by="h1", at="T3")
    assert again.changed and not again.tripped and again.state.tripped_by == "h2"


def test_only_the_last_failures_ids_are_kept() -> None:
    st = BreakerState()
    for i in range(breaker.RECENT + 5):
        st = breaker.step(st, rec(f"f{i}", S.failed, ErrorKind.infra), threshold=100, by="w", at="T").state
    assert st.consecutive == breaker.RECENT + 5 and not st.open
    assert st.recent == [f"f{i}" for i in range(5, breaker.RECENT + 5)]
