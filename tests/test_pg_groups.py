"""Compare groups on the PostgreSQL queue (docs/scale-out.md, "Review from anywhere"): the apply
of one member and the supersedes of the others are one transaction (PgQueue.decide_group), so two
reviewers applying two members at once cannot both be recorded; `fila review --queue` shows only
a DIFF.patch whose bytes match the sha256 its record names. Real PostgreSQL (tests/support/pg.py),
the fake backend for the runner. The shared cases (submit, compare, review, supersede) are in
tests/test_queue_acceptance.py, run against both queues.

Cost: about 9 s (two runner passes, two `fila apply` processes at once, in-process applies).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fila.core.errors import InvalidTransition, Refused
from fila.core.models import Decision, Status, now_iso
from fila.queue.pg.store import PgQueue
from fila.review import groups
from fila.review.groups import group_lock
from fila.review.remote import QueueBook
from tests.support.pg import tamper_blob
from tests.support.pg_runner import CLI, events, fila, host_env
from tests.support.project import GREETING, make_project, make_root

S = Status


def _member(base: Path, url: str, project: Path, tid: str, group: str, line: str) -> None:
    f = base / f"{tid}.json"
    f.write_text(json.dumps({"id": tid, "engine": "shell", "command": f"echo {line} >> greeting.txt",
                             "targets": ["greeting.txt"], "group": group}))  # fmt: skip
    res = fila("submit", str(f), "--queue", url, "--root", str(project))
    assert res.exit_code == 0, res.output


def test_two_members_applied_at_once_record_exactly_one_and_the_other_is_refused_naming_the_winner(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = make_project(tmp_path / "submitter")
    for tid, group in [("a1", "race"), ("a2", "race"), ("b1", "cli"), ("b2", "cli")]:
        _member(tmp_path, pg_url, sub.path, tid, group, f"from-{tid}")
    runner = make_root(tmp_path / "runner")
    env = host_env(tmp_path, "h1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once")
    assert res.exit_code == 0, res.output
    q1, q2, look = PgQueue(pg_url), PgQueue(pg_url), PgQueue(pg_url)  # two reviewers' pools, and ours
    try:
        assert {t: look.get(t).status for t in ("a1", "a2", "b1", "b2")} == dict.fromkeys(
            ("a1", "a2", "b1", "b2"), S.needs_review
        )
        # The decisions themselves, at once: a third connection holds a1's row, so both
        # transactions are inside decide_group, waiting on the group's locks, when it lets go.
        results: dict[str, Any] = {}
        started = threading.Barrier(3)

        def decide(q: PgQueue, tid: str, who: str) -> None:
            started.wait()
            try:
                book = QueueBook(q)  # the root is the reviewer's: a decision does not read it
                results[tid] = book.decide(runner, tid, "apply", by=who, reason=None, expect={S.needs_review})
            except InvalidTransition as e:
                results[tid] = e

        with psycopg.connect(pg_url) as hold:
            hold.execute("SELECT 1 FROM fila_tasks WHERE id = 'a1' FOR UPDATE")
            threads = [threading.Thread(target=decide, args=(q1, "a1", "alice")),
                       threading.Thread(target=decide, args=(q2, "a2", "bob"))]  # fmt: skip
            for t in threads:
                t.start()
            started.wait()
            waiting = (
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
            with psycopg.connect(pg_url, autocommit=True) as watch:
                for _ in range(200):  # both wait on the held row lock (a1's, first in id order)
                    if watch.execute(waiting).fetchone()[0] >= 2:
                        break
                    threading.Event().wait(0.05)
                assert watch.execute(waiting).fetchone()[0] >= 2
            hold.rollback()
        for t in threads:
            t.join(30)
        won = [t for t in ("a1", "a2") if not isinstance(results[t], Exception)]
        assert len(won) == 1, results
        [lost] = {"a1", "a2"} - set(won)
        who = {"a1": "alice", "a2": "bob"}
        assert str(results[lost]).startswith(f"task {lost} was already superseded by {who[won[0]]}")
        assert f"(group race: {won[0]} was applied)" in str(results[lost])
        assert look.get(won[0]).status == S.applied and look.get(lost).status == S.rejected
        assert look.get(lost).decision.action == "superseded"

        # The same two decisions as commands, two reviewers' checkouts, started at once.
        alice, bob = make_project(tmp_path / "alice"), make_project(tmp_path / "bob")
        procs = {
            tid: subprocess.Popen(
                [*CLI, "apply", tid, "--queue", pg_url, "--root", str(r.path), "--yes", "--by", name],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for tid, r, name in (("b1", alice, "alice"), ("b2", bob, "bob"))
        }
        said = {tid: p.communicate(timeout=60) for tid, p in procs.items()}
        done = {tid: (procs[tid].returncode, o, e) for tid, (o, e) in said.items()}
        ok = [t for t, (code, _o, _e) in done.items() if code == 0]
        assert len(ok) == 1, done
        [refused] = {"b1", "b2"} - set(ok)
        winner = {"b1": "alice", "b2": "bob"}[ok[0]]
        code, _o, err = done[refused]
        assert code == 4 and ok[0] in err and winner in err, done
        assert ("superseded by" in err) or (f"whose member {ok[0]} was applied" in err), err
        assert look.get(ok[0]).status == S.applied and look.get(refused).status == S.rejected
        mine = {"b1": alice, "b2": bob}[ok[0]]
        assert (mine.path / "greeting.txt").read_text() == GREETING + f"from-{ok[0]}\n"

        # `fila review --queue`: the verified diff; a DIFF.patch blob altered in the database is
        # refused, nothing shown.
        out = tmp_path / "pages" / "b1.html"
        res = fila("review", ok[0], "--queue", pg_url, "--root", str(alice.path), "--html", "--out", str(out))
        assert res.exit_code == 0 and res.output.strip() == str(out), res.output
        assert f"+from-{ok[0]}" in out.read_text()
        res = fila("review", "a1", "--queue", pg_url, "--root", str(alice.path), "--no-pager")
        assert res.exit_code == 0 and "+from-a1" in res.output, res.output
        sha = look.task_blobs("a1")["DIFF.patch"]
        tamper_blob(pg_url, sha, b"+from-a1", b"+FROM-A1")
        for args in ([], ["--json"], ["--html"]):
            res = fila("review", "a1", "--queue", pg_url, "--root", str(alice.path), "--no-pager", *args)
            assert res.exit_code == 4 and sha in res.output and "FROM-A1" not in res.output, res.output
        assert not (alice.fila / "reviews" / "a1").exists()
    finally:
        for q in (q1, q2, look):
            q.close()


def test_a_groups_targets_go_once_and_its_decision_sent_again_returns_what_the_first_wrote(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store alone (no runner): c1 claimed and published by hand, c2 and c3 left queued; a
    decision whose reply was lost is sent again (db.py retries a transaction) and must not fail."""
    q = PgQueue(pg_url)
    try:
        sub = make_project(tmp_path / "submitter")
        # A group's targets are sent once: the first member's submit sends them, the next none.
        monkeypatch.setenv("OPENAI_API_KEY", "sk-placeholder-not-a-key")
        res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", "d", "--engine", "shell",
                   "--engine", "codex", "--policy", "openai", "--command", "true", "--prompt", "x",
                   "-t", "greeting.txt")  # fmt: skip
        assert res.exit_code == 0 and res.output.split() == ["d.shell", "d.codex"], res.output
        sent = [events(q, t, "submitted")[0]["inputs"]["sent"] for t in ("d.shell", "d.codex")]
        assert sent == [2, 0]  # the manifest and greeting.txt, then nothing
        assert q.task_blobs("d.shell")["input.manifest"] == q.task_blobs("d.codex")["input.manifest"]
        for tid in ("c1", "c2", "c3"):
            _member(tmp_path, pg_url, sub.path, tid, "again", tid)
        lease = q.claim("h1", ["shell"], 30)
        assert lease is not None and lease.task_id == "d.shell"
        lease = q.claim("h1", ["shell"], 30)
        assert lease is not None and lease.task_id == "c1"
        assert q.publish(lease.task_id, lease.token, S.needs_review, {}) is not None
        # The caller's clock says 2000: the decision's time is the database's (its now()), as
        # the supersedes' are.
        made = Decision(action="applied", by="alice", at="2000-01-01T00:00:00.000+00:00", reason=None)
        first = q.decide_group("c1", made, expect={S.needs_review}, supersede={S.needs_review, S.failed})
        assert (first.superseded, first.undecided) == ([], ["c2", "c3"])  # still queued: left
        assert first.record.decision is not None and first.record.decision.at[:4] != "2000"
        again = q.decide_group("c1", made, expect={S.needs_review}, supersede={S.needs_review, S.failed})
        assert again.record == first.record and again.undecided == ["c2", "c3"]
        other = Decision(action="applied", by="bob", at=now_iso(), reason=None)
        with pytest.raises(InvalidTransition):  # another decision on c1: refused
            q.decide_group("c1", other, expect={S.needs_review}, supersede={S.needs_review})
        assert q.get("c1").decision == first.record.decision
        stale = Decision(action="applied", by="bob", at=now_iso(), reason=None)
        lease = q.claim("h1", ["shell"], 30)
        assert lease is not None and lease.task_id == "c2"
        assert q.publish("c2", lease.token, S.needs_review, {}) is not None
        with pytest.raises(InvalidTransition, match="whose member c1 was applied by alice"):
            q.decide_group("c2", stale, expect={S.needs_review}, supersede={S.needs_review})

        # PgQueue.decide rejects a group member as it rejects any task; it applies none: a
        # member is applied only through decide_group (which supersedes the others).
        assert q.decide("c2", S.rejected, stale, expect={S.needs_review}).status == S.rejected
        lease = q.claim("h1", ["shell"], 30)
        assert lease is not None and lease.task_id == "c3"
        assert q.publish("c3", lease.token, S.needs_review, {}) is not None
        with pytest.raises(InvalidTransition, match=r"group 'again'.*decide_group"):
            q.decide("c3", S.applied, stale, expect={S.needs_review})
        assert q.get("c3").status == S.needs_review

        # The same task in a new group is queued; joining a group one of whose members was
        # applied is refused, naming it, and nothing of its batch is queued.
        late = q.get("c3").task.model_copy(update={"id": None})
        assert q.enqueue("c4", late.model_copy(update={"group": "fresh"})).status == S.queued
        with pytest.raises(InvalidTransition, match="joins group 'again', whose member c1 was applied"):
            q.enqueue_group([("c6", late.model_copy(update={"group": "new"})), ("c5", late)])
        assert [r.id for r in q.group_records("again")] == ["c1", "c2", "c3"] and not q.group_records("new")

        # A record whose id is not its row's (altered in the database) is refused, never read as
        # the task asked for (its id would name REVIEW.html's directory and the blobs).
        with psycopg.connect(pg_url) as conn:
            conn.execute("ALTER TABLE fila_records DROP CONSTRAINT fila_records_own_id")
            conn.execute(
                "UPDATE fila_records SET record = jsonb_set(record, '{id}', '\"../x\"') WHERE id = 'c3'"
            )
        assert q.get("c2").id == "c2"
        with pytest.raises(Refused, match=r"names id '\.\./x'"):
            q.get("c3")
        with pytest.raises(Refused, match=r"names id '\.\./x'"):
            q.group_records("again")
    finally:
        q.close()


class _Cut(BaseException):
    """The apply process killed where FILA_CRASH_AT would kill it (in this process, cheaply)."""


def test_a_decision_refused_after_the_landing_is_taken_back_and_one_whose_reply_was_lost_finishes(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """review/apply.py's step 8 refused (another member won meanwhile): the landing is rolled
    back in the reviewer's checkout, marker and copy dropped; after a lost reply whose decision
    committed, running apply again finishes (remote._finish)."""
    from fila.review import apply as apply_mod

    sub = make_project(tmp_path / "submitter")
    for tid, group in [("e1", "late"), ("e2", "late"), ("f1", "lost"), ("f2", "lost"), ("r1", "res"),
                       ("r2", "res")]:  # fmt: skip
        _member(tmp_path, pg_url, sub.path, tid, group, f"from-{tid}")
    runner = make_root(tmp_path / "runner")
    for k, v in host_env(tmp_path, "h1").items():
        monkeypatch.setenv(k, v)
    res = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once")
    assert res.exit_code == 0, res.output
    dave, erin = make_project(tmp_path / "dave"), make_project(tmp_path / "erin")
    q = PgQueue(pg_url)
    try:
        # Dave's apply of f1 lands, then dies before its decision is recorded...
        def cut(name: str) -> None:
            if name == "apply_before_record":
                raise _Cut(name)

        with monkeypatch.context() as m:
            m.setattr(apply_mod, "crash_point", cut)
            with pytest.raises(_Cut):
                fila("apply", "f1", "--queue", pg_url, "--root", str(dave.path), "--yes", "--by", "dave")
        assert (dave.path / "greeting.txt").read_text() == GREETING + "from-f1\n"
        assert q.get("f1").status == S.needs_review and dave.meta("f1").joinpath("applying.json").is_file()
        # ... or its decision committed and only the reply was lost: run again, it finishes.
        made = Decision(action="applied", by="dave", at=now_iso(), reason=None)
        q.decide_group("f1", made, expect={S.needs_review}, supersede={S.needs_review})
        res = fila("apply", "f1", "--queue", pg_url, "--root", str(dave.path), "--yes", "--by", "dave")
        assert res.exit_code == 0 and "(finished an interrupted apply); by dave" in res.output, res.output
        assert "superseded f2 (same group)" in res.output, res.output
        assert not dave.job_dir("f1").exists() and not dave.meta("f1").exists()
        assert (dave.path / "greeting.txt").read_text() == GREETING + "from-f1\n"
        # Another decider's rerun is not "ours": refused, naming dave.
        res = fila("apply", "f1", "--queue", pg_url, "--root", str(erin.path), "--yes", "--by", "erin")
        assert res.exit_code == 4 and "already applied by dave" in res.output, res.output

        # Erin's e1 lands in her checkout; carol's e2 is recorded between the landing and e1's
        # decision: refused, and erin's checkout is as it was.
        original = PgQueue.decide_group

        def carol_first(self: PgQueue, task_id: str, decision: Decision, **kw: Any) -> Any:
            if task_id in ("e1", "r1"):
                assert (erin.path / "greeting.txt").read_text() == GREETING + f"from-{task_id}\n"  # landed
                carol = Decision(action="applied", by="carol", at=now_iso(), reason=None)
                original(self, task_id.replace("1", "2"), carol, **kw)
            return original(self, task_id, decision, **kw)

        monkeypatch.setattr(PgQueue, "decide_group", carol_first)
        # The root's group lock is taken for a queue's member too (two members applied at once
        # from one root queue behind it).
        taken: list[str] = []

        @contextlib.contextmanager
        def lock(root: Any, group: str) -> Iterator[None]:
            with group_lock(root, group):
                taken.append(group)
                yield

        with monkeypatch.context() as m:
            m.setattr(groups, "group_lock", lock)
            res = fila("apply", "e1", "--queue", pg_url, "--root", str(erin.path), "--yes", "--by", "erin")
        assert taken == ["late"]
        assert res.exit_code == 4, res.output
        assert "rolled back 1 file: greeting.txt; task e1 was already superseded by carol" in res.output
        assert (erin.path / "greeting.txt").read_text() == GREETING
        assert not erin.job_dir("e1").exists() and not erin.meta("e1").exists()
        assert q.get("e1").status == S.rejected and q.get("e2").decision.by == "carol"
        assert [e["files"] for e in events(q, "e1", "apply rolled back")] == [["greeting.txt"]]

        # The same in a resumed apply: erin's r1 landed and was cut off; run again, carol's r2
        # is recorded between the finished landing and r1's decision.
        with monkeypatch.context() as m:
            m.setattr(apply_mod, "crash_point", cut)
            with pytest.raises(_Cut):
                fila("apply", "r1", "--queue", pg_url, "--root", str(erin.path), "--yes", "--by", "erin")
        assert (erin.path / "greeting.txt").read_text() == GREETING + "from-r1\n"
        res = fila("apply", "r1", "--queue", pg_url, "--root", str(erin.path), "--yes", "--by", "erin")
        assert res.exit_code == 4, res.output
        assert "rolled back 1 file: greeting.txt; task r1 was already superseded by carol" in res.output
        assert (erin.path / "greeting.txt").read_text() == GREETING
        assert not erin.job_dir("r1").exists() and not erin.meta("r1").exists()
        assert [e["event"] for e in q.events("r1")][-3:] == [
            "apply resumed",
            "superseded",
            "apply rolled back",
        ]
    finally:
        q.close()


def test_compare_html_makes_every_value_inert_before_escaping_it() -> None:
    from fila.review.groups import Comparison, Row, render_html

    bad = "x\x1b]0;PWN\x07\x1b[31mRED\u202eRTL\u200b"
    row = Row(id="h1", engine="shell", model="m", status="needs_review", decision=None, tried=[],
              files=["a.txt"], insertions=1, deletions=0, duration_s=0.1, requests=None,
              input_tokens=None, output_tokens=None, tokens_from=None, cost_usd=None, check=None,
              check_passed=None, check_exit=None, error=None, image=None)  # fmt: skip
    page = render_html(Comparison("g", "p", ["a.txt"], [row]))
    assert "<td>shell</td>" in page and "<code>a.txt</code>" in page  # plain values as they are
    hostile = Row(**{**row.__dict__, "engine": bad, "model": bad, "error": bad, "files": [bad]})
    page = render_html(Comparison("g" + bad, bad, [bad], [hostile]))
    assert not any(c in page for c in "\x1b\x07\u202e\u200b"), page
    assert "x\\x1b]0;PWN\\x07\\x1b[31mRED\\u202eRTL\\u200b" in page
