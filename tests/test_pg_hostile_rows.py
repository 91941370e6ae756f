"""Rows changed outside fila, as whoever holds the queue's credential can change them
(docs/scale-out.md, "What fila promises"): a record, an event, the breaker's or a runner's row that
does not read, or a task whose row and document disagree, fails or is named alone; the claim, the
sweep, the runners, `ls`, `show`, `status` and `logs` go on with every other row (the allowed
counterpart: a good task beside each bad one). Real PostgreSQL, the fake backend; no containers."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fila.core.errors import FilaError, Refused
from fila.core.layout import Root
from fila.core.models import Status, Task
from fila.queue.pg.store import PgQueue
from tests.support.pg_runner import fila
from tests.support.project import make_project, make_root

S = Status
NESTED = "[" * 1500 + "]" * 1500
HUGE = "1" + "0" * 5000  # an integer past Python's int-from-string limit (4300 digits)


def task() -> Task:
    return Task(engine="shell", targets=["a.txt"], command="true")


def sql(url: str, statement: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, args or None)
        return cur.fetchall() if cur.description else []


# -- the claim ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "how",
    [
        # the right shape, one field the wrong type: Record.model_validate outside the claim's try
        "jsonb_set(record, '{attempt}', '\"x\"')",
        # nested past the recursion limit (in a key Record ignores): json.loads -> RecursionError
        "record || jsonb_build_object('x', %s::jsonb)",
        # a number the standard library will not read: json.loads -> ValueError
        "record || jsonb_build_object('x', %s::jsonb)",
    ],
    ids=["wrong-type", "deep", "huge-number"],
)
def test_claim_a_queued_task_whose_record_is_hostile_fails_it_alone(
    q: PgQueue, pg_url: str, how: str, request: pytest.FixtureRequest
) -> None:
    q.enqueue("poison", task())
    q.enqueue("good", task())
    arg = {"deep": NESTED, "huge-number": HUGE}.get(request.node.callspec.id)
    sql(pg_url, f"UPDATE fila_records SET record = {how} WHERE id = 'poison'", *([arg] if arg else []))
    try:
        lease = q.claim("r1", ["shell"], 30)
    except FilaError:
        lease = None  # a clear refusal would be acceptable only if the good task were then claimable
    except BaseException as e:
        pytest.fail(f"claim raised {type(e).__name__} (not a FilaError): a runner crash, every claim")
    if lease is None or lease.task_id != "good":
        lease = q.claim("r1", ["shell"], 30)
    assert lease is not None and lease.task_id == "good"


# -- reviewers' reads ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["wrong-type", "deep", "huge-number"])
def test_ls_queue_with_one_hostile_record_lists_the_others(
    q: PgQueue, pg_url: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q.enqueue("good", task())
    q.enqueue("bad", task())
    how = {
        "wrong-type": ("jsonb_set(record, '{attempt}', '\"x\"')", None),
        "deep": ("record || jsonb_build_object('x', %s::jsonb)", NESTED),
        "huge-number": ("record || jsonb_build_object('x', %s::jsonb)", HUGE),
    }[kind]
    sql(pg_url, f"UPDATE fila_records SET record = {how[0]} WHERE id = 'bad'", *([how[1]] if how[1] else []))
    monkeypatch.chdir(tmp_path)
    from typer.testing import CliRunner

    from fila.cli import app

    res = CliRunner().invoke(app, ["ls", "--queue", pg_url])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "good" in res.output and "bad" in res.output, res.output


def test_show_queue_of_a_hostile_record_is_a_clear_error(
    q: PgQueue, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q.enqueue("bad", task())
    sql(pg_url, "UPDATE fila_records SET record = record || jsonb_build_object('x', %s::jsonb) "
        "WHERE id = 'bad'", NESTED)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    from typer.testing import CliRunner

    from fila.cli import app

    res = CliRunner().invoke(app, ["show", "bad", "--queue", pg_url])
    assert isinstance(res.exception, SystemExit) and res.exit_code not in (0, 1), repr(res.exception)
    assert "bad" in res.output


# -- the breaker's and the runners' rows ----------------------------------------------------------


def test_a_breaker_row_with_a_null_in_recent_reads_and_the_claim_loop_goes_on(
    q: PgQueue, pg_url: str
) -> None:
    assert q.breaker().open is False and q.breaker().recent == []
    sql(pg_url, "UPDATE fila_breaker SET recent = ARRAY['x', NULL]::text[]")
    assert q.breaker().open is False and q.breaker().recent == ["x"]  # the NULL left out


def test_status_queue_with_a_hostile_runners_row(
    q: PgQueue, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q.runner_up("h1", ["shell"], images={}, slots=1)
    sql(pg_url, "UPDATE fila_runners SET images = %s::jsonb WHERE id = 'h1'", NESTED)
    monkeypatch.chdir(tmp_path)
    from typer.testing import CliRunner

    from fila.cli import app

    res = CliRunner().invoke(app, ["status", "--queue", pg_url])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code in (0,) or "h1" in res.output, res.output


def test_status_queue_with_a_null_engine_in_a_runners_row(
    q: PgQueue, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q.runner_up("h1", ["shell"], images={}, slots=1)
    sql(pg_url, "UPDATE fila_runners SET engines = ARRAY['shell', NULL]::text[] WHERE id = 'h1'")
    monkeypatch.chdir(tmp_path)
    from typer.testing import CliRunner

    from fila.cli import app

    res = CliRunner().invoke(app, ["status", "--queue", pg_url])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)


# -- runners ------------------------------------------------------------------------------------


@pytest.fixture
def sub(tmp_path: Path) -> Any:
    return make_project(tmp_path / "submitter", {"src/a.py": "x = 1\n"})


def submit(url: str, sub: Any, tid: str, command: str) -> None:
    res = fila("submit", "--queue", url, "--root", str(sub.path), "--id", tid, "--engine", "shell",
               "--command", command, "-t", "greeting.txt")  # fmt: skip
    assert res.exit_code == 0, res.output


def worker(tmp_path: Path, url: str, **kw: Any) -> Any:
    from fila.run.remote import RemoteWorker
    from fila.sandbox.fake import FakeBackend

    root = Root(tmp_path / "h1") if (tmp_path / "h1").exists() else make_root(tmp_path / "h1")
    return RemoteWorker(root, url, host_id="h1", engines=["shell"], once=True, poll_s=0.2,
                        backend=FakeBackend(tmp_path / "boxes"), **kw)  # fmt: skip


def run_through(w: Any) -> None:
    """Runs the `--once` runner `w` to its end: a fila error (exit 3, say) is an answer; anything
    else is a crash, which the test names."""
    try:
        w.run()
    except FilaError:
        pass
    except BaseException as e:
        pytest.fail(f"the runner crashed: {type(e).__name__}: {str(e)[:200]}")


def test_a_runner_survives_a_queued_task_whose_record_is_hostile(
    pg_url: str, q: PgQueue, sub: Any, tmp_path: Path
) -> None:
    submit(pg_url, sub, "poison", "echo 1 >> greeting.txt")
    submit(pg_url, sub, "good", "echo 2 >> greeting.txt")
    sql(pg_url, "UPDATE fila_records SET record = jsonb_set(record, '{timings}', "
        "jsonb_build_object('total', %s::jsonb)) WHERE id = 'poison'", "1" + "0" * 400)  # fmt: skip
    w = worker(tmp_path, pg_url)
    run_through(w)
    assert q.task_state("good")["state"] == "needs_review"


def test_a_runner_survives_a_breaker_row_with_a_null_in_recent(
    pg_url: str, q: PgQueue, sub: Any, tmp_path: Path
) -> None:
    submit(pg_url, sub, "good", "echo 2 >> greeting.txt")
    sql(pg_url, "UPDATE fila_breaker SET recent = ARRAY['x', NULL]::text[]")
    w = worker(tmp_path, pg_url)
    run_through(w)


def test_a_sweep_survives_an_expired_lease_whose_record_is_deep(q: PgQueue, pg_url: str) -> None:
    q.enqueue("bad", task())
    q.enqueue("good", task())
    bad = q.claim("r1", ["shell"], 0.05)
    good = q.claim("r2", ["shell"], 0.05)
    assert bad is not None and good is not None and bad.task_id == "bad"
    sql(pg_url, "UPDATE fila_records SET record = record || jsonb_build_object('x', %s::jsonb) "
        "WHERE id = 'bad'", NESTED)  # fmt: skip
    time.sleep(0.3)
    try:
        out = q.sweep()
    except BaseException as e:
        pytest.fail(f"sweep raised {type(e).__name__}: every runner sweeps before each claim")
    assert ("good", S.queued) in out


def test_a_task_whose_stderr_holds_a_nul_is_published(
    pg_url: str, q: PgQueue, sub: Any, tmp_path: Path
) -> None:
    submit(pg_url, sub, "nul", "printf 'boom\\000x\\n' >&2; exit 3")
    w = worker(tmp_path, pg_url)
    try:
        w.run()
    except FilaError as e:
        pytest.fail(f"the runner stopped: {e}")
    rec = q.get("nul")
    assert rec.status == S.failed, (rec.status, rec.error, q.task_state("nul"))


def test_claim_a_queued_task_whose_record_says_another_status(q: PgQueue, pg_url: str) -> None:
    """The row says queued, the record says applied: the task fails alone (its record kept for a
    person) and the next one is claimed."""
    q.enqueue("poison", task())
    q.enqueue("good", task())
    sql(pg_url, "UPDATE fila_records SET record = jsonb_set(record, '{status}', '\"applied\"') "
        "WHERE id = 'poison'")  # fmt: skip
    from fila.core.errors import InfraError

    for _ in range(2):
        try:
            lease = q.claim("r1", ["shell"], 30)
        except InfraError:
            continue
        except BaseException as e:
            pytest.fail(f"claim raised {type(e).__name__} ({e}): _claims catches InfraError only")
        if lease is not None and lease.task_id == "good":
            return
    pytest.fail("good never claimed")


def test_a_runner_survives_a_queued_record_with_another_status(
    pg_url: str, q: PgQueue, sub: Any, tmp_path: Path
) -> None:
    submit(pg_url, sub, "poison", "echo 1 >> greeting.txt")
    submit(pg_url, sub, "good", "echo 2 >> greeting.txt")
    sql(pg_url, "UPDATE fila_records SET record = jsonb_set(record, '{status}', '\"applied\"') "
        "WHERE id = 'poison'")  # fmt: skip
    w = worker(tmp_path, pg_url)
    try:
        w.run()
    except BaseException as e:
        pytest.fail(f"the runner stopped: {type(e).__name__}: {str(e)[:200]}; good is "
                    f"{q.task_state('good')['state']}")  # fmt: skip
    assert q.task_state("good")["state"] == "needs_review"


@pytest.mark.parametrize("doc_engine", ["claude", "nosuch"])
def test_a_task_whose_row_engine_differs_from_its_document(
    pg_url: str, q: PgQueue, sub: Any, tmp_path: Path, doc_engine: str
) -> None:
    """A row whose engine column (what the claim filters on) is not its document's engine (what
    would run): the task fails `invalid`, never runs another engine than the one claimed for."""
    submit(pg_url, sub, "odd", "echo 1 >> greeting.txt")
    sql(pg_url, "UPDATE fila_tasks SET task = jsonb_set(task, '{engine}', to_jsonb(%s::text)) "
        "WHERE id = 'odd'", doc_engine)  # fmt: skip
    w = worker(tmp_path, pg_url)
    from fila.engines import get_engine

    w.backend.remove_image(get_engine("claude").image_tag())  # this host has no claude image
    w.once = False
    errs: list[BaseException] = []

    def go() -> None:
        try:
            w.run()
        except BaseException as e:
            errs.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    time.sleep(4)
    w.cancel.set()
    w.wake.set()
    t.join(30)
    claims = [e for e in q.events("odd") if e["event"] == "claimed"]
    st = q.task_state("odd")
    assert not errs, f"the runner crashed: {errs[0]!r}"
    assert len(claims) <= 2, f"claimed {len(claims)} times in 4 s; state {st['state']}, tries {st['tries']}"
    assert st["state"] == "failed", st


def test_a_runner_survives_its_running_task_record_changed_under_it(
    pg_url: str, q: PgQueue, sub: Any, tmp_path: Path
) -> None:
    submit(pg_url, sub, "t", "sleep 1; echo 1 >> greeting.txt")
    submit(pg_url, sub, "good", "echo 2 >> greeting.txt")

    def progress(msg: str) -> None:
        if msg.startswith("t: claimed"):
            sql(pg_url, "UPDATE fila_records SET record = jsonb_set(record, '{attempt}', '\"x\"') "
                "WHERE id = 't'")  # fmt: skip

    w = worker(tmp_path, pg_url, progress=progress)
    run_through(w)
    assert q.task_state("good")["state"] == "needs_review"


@pytest.mark.parametrize("field,value", [("project", "5"), ("project", '["a"]'), ("group", '{"a": 1}')])
def test_show_queue_of_a_record_whose_task_is_the_wrong_type(
    q: PgQueue, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: str
) -> None:
    q.enqueue("bad", task())
    sql(pg_url, f"UPDATE fila_records SET record = jsonb_set(record, '{{task,{field}}}', %s::jsonb) "
        "WHERE id = 'bad'", value)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    from typer.testing import CliRunner

    from fila.cli import app

    for cmd in (["show", "bad", "--queue", pg_url], ["ls", "--queue", pg_url]):
        res = CliRunner().invoke(app, cmd)
        assert res.exception is None or isinstance(res.exception, SystemExit), (cmd, repr(res.exception))


def test_claim_refuses_a_stored_task_over_the_task_size_cap(q: PgQueue, pg_url: str) -> None:
    """A stored task over a task file's cap (MAX_TASK_BYTES, as `fila submit -` has it) fails at
    the claim rather than be copied into its record at every change."""
    from fila.core.untrusted import MAX_TASK_BYTES

    q.enqueue("big", task())
    sql(pg_url, "UPDATE fila_tasks SET task = jsonb_set(task, '{prompt}', to_jsonb(repeat('a', %s))) "
        "WHERE id = 'big'", 8 * MAX_TASK_BYTES)  # fmt: skip
    lease = q.claim("r1", ["shell"], 30)
    assert lease is None, f"claimed a {len(lease.task.prompt)}-character prompt"
    rec = q.get("big")
    assert rec.status == S.failed


def test_logs_events_queue_with_a_deep_event(
    q: PgQueue, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fila_events is append-only: an event that does not read is shown as unreadable, and the
    task's other events with it."""
    q.enqueue("t", task())
    sql(pg_url, "INSERT INTO fila_events (task_id, event, data) VALUES "
        "('t', 'x', jsonb_build_object('x', %s::jsonb))", NESTED)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    from typer.testing import CliRunner

    from fila.cli import app

    res = CliRunner().invoke(app, ["logs", "t", "--events", "--queue", pg_url])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)


def test_group_records_with_one_deep_member_record(q: PgQueue, pg_url: str) -> None:
    """`fila apply/compare --queue` of any member reads every member's record (group_records):
    one that does not read is a clear error naming it."""
    for tid in ("m1", "m2"):
        q.enqueue(tid, task().model_copy(update={"group": "g"}))
    sql(pg_url, "UPDATE fila_records SET record = record || jsonb_build_object('x', %s::jsonb) "
        "WHERE id = 'm2'", NESTED)  # fmt: skip
    try:
        q.group_records("g")
    except FilaError:
        pass
    except BaseException as e:
        pytest.fail(f"group_records raised {type(e).__name__}, not a FilaError naming m2")


def cli(*args: str) -> Any:
    from typer.testing import CliRunner

    from fila.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    "how",
    ["jsonb_set(record, '{task}', 'null')", "jsonb_set(record, '{container_started}', 'true')"],
    ids=["task-null", "container-started"],
)
def test_a_queued_record_that_reads_but_cannot_become_running_fails_alone(
    q: PgQueue, pg_url: str, how: str
) -> None:
    q.enqueue("poison", task())
    q.enqueue("good", task())
    sql(pg_url, f"UPDATE fila_records SET record = {how} WHERE id = 'poison'")
    lease = q.claim("r1", ["shell"], 30)
    assert lease is not None and lease.task_id == "good"
    assert q.task_state("poison")["state"] == "failed"


def test_a_refusal_whose_record_was_changed_meanwhile_publishes_nothing_and_the_runner_goes_on(
    pg_url: str, q: PgQueue, sub: Any, tmp_path: Path
) -> None:
    submit(pg_url, sub, "t", "echo 1 >> greeting.txt")
    submit(pg_url, sub, "good", "echo 2 >> greeting.txt")

    def progress(msg: str) -> None:  # no targets to lay out (a refusal), and a record that no longer reads
        if msg.startswith("t: claimed"):
            sql(pg_url, "DELETE FROM fila_task_blobs WHERE task_id = 't'")
            sql(
                pg_url,
                "UPDATE fila_records SET record = jsonb_set(record, '{attempt}', '\"x\"') WHERE id = 't'",
            )

    run_through(worker(tmp_path, pg_url, progress=progress))
    assert q.task_state("good")["state"] == "needs_review" and q.task_state("t")["state"] == "running"


def test_submit_run_stops_waiting_when_the_claim_failed_a_task_whose_record_says_otherwise(
    q: PgQueue, pg_url: str
) -> None:
    q.enqueue("t", task())
    sql(pg_url, "UPDATE fila_records SET record = record || '{\"status\": \"running\", \"worker\": \"x\"}' "
        "WHERE id = 't'")  # fmt: skip
    assert q.claim("r1", ["shell"], 30) is None and q.task_state("t")["state"] == "failed"
    with pytest.raises(Refused, match="its row says failed, its record running"):
        q.wait_settled("t", poll_s=0.1)


def test_status_lists_the_other_runners_beside_a_row_with_two_dimensional_arrays(
    q: PgQueue, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q.runner_up("h1", ["shell"], images={}, slots=1, policies=["default"])
    q.runner_up("h2", ["shell"], images={}, slots=1)
    sql(pg_url, "UPDATE fila_runners SET engines = '{{shell,x},{a,b}}'::text[], "
        "policies = '{{default,x},{a,b}}'::text[] WHERE id = 'h1'")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    res = cli("status", "--queue", pg_url)
    assert res.exit_code == 0 and "h1" in res.output and "h2" in res.output, res.output


def test_apply_of_a_record_without_its_task_is_refused_naming_it_and_ls_names_a_missing_record(
    pg_url: str, q: PgQueue, sub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    submit(pg_url, sub, "t", "echo 1 >> greeting.txt")
    submit(pg_url, sub, "norec", "true")
    run_through(worker(tmp_path, pg_url))
    assert q.get("t").status == S.needs_review
    sql(pg_url, "UPDATE fila_records SET record = jsonb_set(record, '{task}', 'null') WHERE id = 't'")
    sql(pg_url, "DELETE FROM fila_records WHERE id = 'norec'")
    res = cli("apply", "t", "--queue", pg_url, "--root", str(sub.path), "--yes", "--by", "dave")
    assert res.exit_code == 4 and "has no task" in res.output, res.output
    monkeypatch.chdir(tmp_path)
    res = cli("ls", "--queue", pg_url)
    assert "t  needs_review" in res.output and "norec  unreadable  (its record row is missing)" in res.output
