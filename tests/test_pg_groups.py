"""Compare groups on the PostgreSQL queue (docs/scale-out.md, "Review from anywhere"): the apply
of one member and the supersedes of the others are one transaction (PgQueue.decide_group), so two
reviewers applying two members at once cannot both be recorded; `fila review --queue` shows only
a DIFF.patch whose bytes match the sha256 its record names. Real PostgreSQL (tests/support/pg.py),
the fake backend for the runner. The shared cases (submit, compare, review, supersede) are in
tests/test_queue_acceptance.py, run against both queues.

Cost: about 7 s (one runner pass, two `fila apply` processes at once).
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fila.core.errors import InvalidTransition
from fila.core.models import Decision, Status, now_iso
from fila.queue.pg.store import PgQueue
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
        made = Decision(action="applied", by="alice", at=now_iso(), reason=None)
        first = q.decide_group("c1", made, expect={S.needs_review}, supersede={S.needs_review, S.failed})
        assert (first.superseded, first.undecided) == ([], ["c2", "c3"])  # still queued: left
        again = q.decide_group("c1", made, expect={S.needs_review}, supersede={S.needs_review, S.failed})
        assert again.record == first.record and again.undecided == ["c2", "c3"]
        other = Decision(action="applied", by="bob", at=now_iso(), reason=None)
        with pytest.raises(InvalidTransition):  # another decision on c1: refused
            q.decide_group("c1", other, expect={S.needs_review}, supersede={S.needs_review})
        assert q.get("c1").decision == made
    finally:
        q.close()
