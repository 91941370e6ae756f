"""The Python API (fila.Client, docs/api.md) through the acceptance cycle on both queues: submit
with the task file's checks and errors, run in process (file queue) or by a runner (PostgreSQL),
wait with a timeout, the record, diff, review, log, a compare group, apply and reject with a
decider; the same structures and words as the CLI's, since the CLI calls it (one code path).

Real `fila` processes where the CLI is the comparison, the fake backend (no containers), a real
PostgreSQL server (tests/support/pg.py). Each refused case shows its allowed counterpart first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import fila
from fila.core.errors import DuplicateId, InvalidTaskFile, InvalidTransition, NotFound, TargetError, TimedOut
from fila.core.models import Task
from tests.support.project import GREETING, make_project
from tests.support.queues import PLACEHOLDER_KEY, Driver, FileDriver, PgDriver


@pytest.fixture(params=["file", "pg"])
def queue(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Driver]:
    if request.param == "file":
        d: Driver = FileDriver(tmp_path)
        monkeypatch.setenv("FILA_FAKE_DIR", str(tmp_path / "boxes"))
    else:
        d = PgDriver(tmp_path, request.getfixturevalue("pg_url"))
    monkeypatch.setenv("FILA_BACKEND", "fake")
    monkeypatch.setenv("OPENAI_API_KEY", PLACEHOLDER_KEY)  # policy openai's route must have one
    try:
        yield d
    finally:
        if isinstance(d, PgDriver):
            d.close()


def clients(queue: Driver) -> tuple[fila.Client, fila.Client]:
    """The submitter's client and the reviewer's (one root on the file queue)."""
    url = queue.url if isinstance(queue, PgDriver) else None
    return fila.Client(queue.project.path, queue=url), fila.Client(queue.reviewer.path, queue=url)


def test_the_api_runs_the_cycle_with_the_clis_checks_structures_and_errors(queue: Driver) -> None:
    sub, rev = clients(queue)
    with sub, rev:
        # The task file's checks and errors: a target outside the project, a field the schema refuses.
        cmd = "echo said-hi; echo bye >> greeting.txt"
        ok = sub.submit(engine="shell", command=cmd, targets=["greeting.txt"], id="t1", submitter="a-bot")
        assert (ok.id, ok.status) == ("t1", "queued") and ok.task and ok.task.submitter == "a-bot"
        with pytest.raises(TargetError, match="outside the project"):
            sub.submit(engine="shell", command="true", targets=["../x"])
        with pytest.raises(InvalidTaskFile, match="timeout"):
            sub.submit({"engine": "shell", "command": "true", "targets": ["greeting.txt"], "timeout": 5})
        with pytest.raises(DuplicateId):
            sub.submit(Task(engine="shell", command="true", targets=["greeting.txt"]), id="t1")
        # Nobody runs it yet: the wait ends at its timeout, the task left queued.
        with pytest.raises(TimedOut, match="still queued"):
            sub.wait("t1", timeout=0.3)
        assert sub.record("t1").status == "queued"

        if isinstance(queue, PgDriver):
            with queue.runner():
                rec = sub.wait("t1", timeout=60)
            with pytest.raises(Exception, match="runners"):
                sub.run(["t1"])
        else:
            run = sub.run(["t1"])
            assert run.code == 0 and [r.id for r in run.records] == ["t1"]
            rec = sub.wait("t1", timeout=0)
        assert rec.status == "needs_review" and rec.diffstat and rec.diffstat.insertions == 1

        # Record, diff, review, log: what the CLI prints, from the same functions.
        assert rev.record("t1").model_dump(mode="json") == queue.record("t1")
        assert b"+bye\n" in rev.diff("t1")
        assert rev.review_json("t1") == json.loads(queue.fila("review", "t1", "--json").stdout)
        assert b"said-hi" in rev.log("t1") and b'"event"' in rev.log("t1", events=True)
        with pytest.raises(NotFound, match="no task 'nope'"):
            rev.record("nope")

        # The decision, with a decider; a second one is refused naming who decided.
        applied = rev.apply("t1", by="alice", reason="good")
        assert applied.record.status == "applied" and applied.written == ["greeting.txt"]
        assert (queue.reviewer.path / "greeting.txt").read_text() == GREETING + "bye\n"
        with pytest.raises(InvalidTransition, match="already applied by alice"):
            rev.reject("t1", by="bob")


def test_the_api_queues_a_group_compares_it_and_rejects_with_a_decider(queue: Driver) -> None:
    sub, rev = clients(queue)
    with sub, rev:
        doc = {"command": "echo x >> greeting.txt", "targets": ["greeting.txt"], "prompt": "tidy"}
        members = sub.submit_group(doc, ["shell", "codex"], id="g", policy="openai")
        assert [m.id for m in members] == ["g.shell", "g.codex"]
        got = rev.compare_json("g")
        assert got == json.loads(queue.fila("compare", "g", "--json").stdout)
        assert [r["id"] for r in got["rows"]] == ["g.codex", "g.shell"]
        with pytest.raises(NotFound, match="no task in group 'nope'"):
            rev.compare("nope")
        # Queued, not yet run: reject is refused (the state machine), and is recorded once run.
        with pytest.raises(InvalidTransition):
            rev.reject("g.shell", by="bob")
        if isinstance(queue, PgDriver):
            queue.run_once()
        else:
            assert sub.run().code == 2  # both invalid: the fake backend runs no network allowlist
        rec = rev.reject("g.shell", by="bob", reason="not this")
        assert rec.status == "rejected" and rec.decision and (rec.decision.by, rec.decision.reason) == (
            "bob", "not this")  # fmt: skip


def test_the_documented_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/api.md's example, as written but for its root, on the fake backend: it decides the task
    (the fake backend's warning, "not a sandbox", makes it reject)."""
    import re

    root = make_project(tmp_path / "project")
    monkeypatch.setenv("FILA_BACKEND", "fake")
    monkeypatch.setenv("FILA_FAKE_DIR", str(tmp_path / "boxes"))
    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S)
    assert code is not None
    exec(compile(code.group(1).replace("/srv/project", str(root.path)), "docs/api.md", "exec"), {})
    [rec] = fila.Client(root.path).listing().records
    assert rec.status == "rejected" and rec.decision and rec.decision.by == "my-ci-bot"
    assert rec.task and rec.task.submitter == "my-ci-bot"
