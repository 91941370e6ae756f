"""The acceptance tests both queues pass (issue 23, "Done means"): the cycle, the review gate and
durability, each test body run against the file queue and against the PostgreSQL queue through a
driver (tests/support/queues.py) that hides only where the commands run. Real `fila` processes on
the fake backend (no containers) and a real PostgreSQL server (tests/support/pg.py). Each refused
case shows its allowed counterpart first.

Cost: about 70 s for both queues together, 45 s of it the PostgreSQL side's (two leases of 3 s
lapse, and each command is a process that loads the database driver); most of the rest is fila's
start-up, one process per command. The compare group's test is about 28 s of it (10 s file, 15 s
PostgreSQL: some twenty commands each). The default run leaves out the file queue's run of the
two longest (PG_BY_DEFAULT): about 16 s.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.project import GREETING
from tests.support.queues import NOTES, Driver, FileDriver, PgDriver, wait_for


@pytest.fixture(params=["file", "pg"])
def queue(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Driver]:
    """A fresh queue of each kind: the PostgreSQL one in a new database of the session's cluster."""
    if request.param == "file":
        yield FileDriver(tmp_path)
        return
    pg = PgDriver(tmp_path, request.getfixturevalue("pg_url"))
    try:
        yield pg
    finally:
        pg.close()


# The two longest cases run on the file queue in --all only: every run proves the same on it with
# fila's own tests (the group in tests/test_compare.py, a worker killed before and after its
# container started in tests/test_durability.py); the PostgreSQL queue's run is every run's.
PG_BY_DEFAULT = pytest.mark.parametrize(
    "queue", [pytest.param("file", marks=pytest.mark.matrix), "pg"], indirect=True
)


def out(res: subprocess.CompletedProcess[str]) -> str:
    """What a failed assertion shows of a command."""
    return f"exit {res.returncode}\n{res.stdout}{res.stderr}"


def test_a_submitted_task_runs_once_and_its_record_says_done_with_the_diff(queue: Driver) -> None:
    res = queue.submit("t1", "echo said-hello; echo bye >> greeting.txt")
    assert res.returncode == 0 and res.stdout.strip() == "t1", out(res)
    assert queue.state("t1") == "queued" and queue.starts() == 0
    empty = queue.fila("logs", "t1")  # no log yet: an empty one; exit 5 is for no such task
    assert (empty.returncode, empty.stdout) == (0, ""), out(empty)
    unknown = queue.fila("logs", "nope")
    assert unknown.returncode == 5 and "no task 'nope'" in unknown.stderr, out(unknown)
    ran = queue.run_once()
    assert ran.returncode == 0 and ran.stdout.startswith("t1  needs_review"), out(ran)
    rec = queue.record("t1")
    assert rec["status"] == "needs_review" and rec["attempt"] == 1 and rec["exit_code"] == 0
    assert rec["diffstat"]["files"] == 1 and rec["diffstat"]["insertions"] == 1
    [attempt] = rec["attempts"]
    assert attempt["engine"] == "shell" and attempt["outcome"] == "success"
    diff = queue.fila("diff", "t1")
    assert diff.returncode == 0 and "+bye\n" in diff.stdout, out(diff)
    assert hashlib.sha256(diff.stdout.encode()).hexdigest() == rec["patch_sha256"]
    logs = queue.fila("logs", "t1")
    assert logs.returncode == 0 and "said-hello" in logs.stdout, out(logs)
    listed = queue.fila("ls")
    assert listed.returncode == 0 and "t1  needs_review" in listed.stdout, out(listed)
    again = queue.run_once()  # nothing queued: the task is not run twice
    assert again.returncode == 0 and queue.starts() == 1, out(again)

    # `submit --run` returns when the record is there, with run --once's exit codes.
    with queue.runs_submitted():
        ok = queue.submit("ok", "echo w >> greeting.txt", "--run")
        assert ok.returncode == 0 and ok.stdout.startswith("ok  needs_review"), out(ok)
        bad = queue.submit("bad", "exit 3", "--run")
        assert bad.returncode == 1 and bad.stdout.startswith("bad  failed"), out(bad)
    rec = queue.record("bad")
    assert rec["error"]["kind"] == "engine_error" and rec["exit_code"] == 3
    assert queue.starts() == 3


def test_nothing_lands_until_apply_and_a_decision_is_taken_once(queue: Driver) -> None:
    for tid, command, target in [("a", "echo bye >> greeting.txt", "greeting.txt"),
                                 ("b", "echo other >> greeting.txt", "greeting.txt"),
                                 ("c", "sed -i 's/^line 1$/line one/' notes.txt", "notes.txt")]:  # fmt: skip
        res = queue.submit(tid, command, target=target)
        assert res.returncode == 0, out(res)
    ran = queue.run_once()
    assert ran.returncode == 0, out(ran)
    assert [queue.state(t) for t in "abc"] == ["needs_review"] * 3
    greeting, notes = queue.reviewer.path / "greeting.txt", queue.reviewer.path / "notes.txt"
    for root in (queue.project, queue.reviewer):  # nothing landed anywhere
        assert (root.path / "greeting.txt").read_text() == GREETING
        assert (root.path / "notes.txt").read_text() == NOTES

    res = queue.fila("apply", "a", "--yes", "--by", "alice")
    assert res.returncode == 0, out(res)
    assert res.stdout.startswith(f"applied a to {queue.reviewer.path}: 1 written, 0 deleted; by alice")
    assert greeting.read_text() == GREETING + "bye\n"
    rec = queue.record("a")
    assert rec["status"] == "applied" and rec["decision"]["by"] == "alice"
    # A second decision on a, either way, is refused naming who decided; nothing more lands.
    for cmd in (["apply", "--yes"], ["reject"]):
        res = queue.fila(*cmd, "a", "--by", "bob")
        assert res.returncode == 4 and "task a was already applied by alice" in res.stderr, out(res)
    assert greeting.read_text() == GREETING + "bye\n"

    res = queue.fila("reject", "b", "--by", "bob", "-m", "not this")
    assert res.returncode == 0 and res.stdout.strip() == "rejected b by bob: not this", out(res)
    res = queue.fila("apply", "b", "--yes", "--by", "alice")
    assert res.returncode == 4 and "task b was already rejected by bob" in res.stderr, out(res)
    assert greeting.read_text() == GREETING + "bye\n" and queue.state("b") == "rejected"

    # notes.txt moved in the reviewer's checkout since c copied it: refused, unless --3way merges.
    notes.write_text(NOTES + "line 11\n")
    res = queue.fila("apply", "c", "--yes", "--by", "alice")
    assert res.returncode == 4 and "moved base" in res.stderr, out(res)
    assert notes.read_text() == NOTES + "line 11\n" and queue.state("c") == "needs_review"
    res = queue.fila("apply", "c", "--yes", "--3way", "--by", "alice")
    assert res.returncode == 0, out(res)
    assert notes.read_text() == NOTES.replace("line 1\n", "line one\n", 1) + "line 11\n"
    assert queue.state("c") == "applied"


@PG_BY_DEFAULT
def test_a_worker_killed_before_its_container_runs_the_task_once_more_and_after_leaves_it_to_a_person(
    queue: Driver, tmp_path: Path
) -> None:
    # Killed before the container started: settled back to the queue, run once more, exactly once,
    # by another worker.
    assert queue.submit("early", "echo ran >> greeting.txt").returncode == 0
    crashed = queue.run_once(crash="after_begin")
    assert crashed.returncode == -signal.SIGKILL, out(crashed)
    assert queue.starts() == 0
    queue.settle("early")
    assert queue.state("early") == "queued"
    ran = queue.run_once(host="h2")
    assert ran.returncode == 0 and ran.stdout.startswith("early  needs_review"), out(ran)
    rec = queue.record("early")
    assert rec["status"] == "needs_review" and rec["attempt"] == 2 and queue.starts() == 1
    lost, done = rec["attempts"]
    assert (lost["outcome"], lost["error"]["kind"], done["outcome"]) == ("lost", "infra", "success")
    assert lost["worker"] != done["worker"]
    assert queue.run_once(host="h2").returncode == 0 and queue.starts() == 1

    # Killed while its container ran: a person's, never run again in silence, until `fila retry`.
    # (The first run sleeps past the first heartbeat, where the crash point is; the retry does not.)
    once = tmp_path / "slept"
    command = f"echo late >> greeting.txt; if mkdir {once} 2>/dev/null; then sleep 2; fi"
    assert queue.submit("late", command).returncode == 0
    crashed = queue.run_once(crash="after_container_start")
    assert crashed.returncode == -signal.SIGKILL, out(crashed)
    assert queue.starts() == 2
    queue.settle("late")
    rec = queue.record("late")
    assert rec["status"] == "needs_human" and "Nothing was run again" in rec["diagnosis"], rec
    [lost] = rec["attempts"]
    assert lost["outcome"] == "lost" and rec["error"]["kind"] == "interrupted"
    assert "container ran" in rec["error"]["message"]
    if queue.name == "pg":  # a runner that lost its lease publishes nothing, its partial diff neither
        assert rec["diffstat"] is None and rec["patch_sha256"] is None
    else:  # recovery keeps work/'s partial diff beside the record as evidence
        assert rec["diffstat"]["files"] == 1
    ran = queue.run_once(host="h2")
    assert ran.returncode == 0 and queue.state("late") == "needs_human", out(ran)
    assert queue.starts() == 2
    res = queue.fila("retry", "late", "--by", "carol")
    assert res.returncode == 0 and queue.state("late") == "queued", out(res)
    ran = queue.run_once(host="h2")
    assert ran.returncode == 0 and ran.stdout.startswith("late  needs_review"), out(ran)
    assert queue.starts() == 3
    assert queue.left() == []


def test_a_task_for_an_engine_no_worker_has_is_not_run(queue: Driver) -> None:
    """PostgreSQL: the task waits, queued, and `fila status --queue` names it. The file queue has no
    list of a worker's engines: a worker claims it, finds the engine's image missing, and requeues
    it with a backoff (an infra error, counted); after five attempts it fails (retry.INFRA)."""
    with queue.runner(images=["shell"]):
        res = queue.submit("sh", "echo w >> greeting.txt")  # the allowed counterpart: it runs
        assert res.returncode == 0, out(res)
        cx = queue.submit_task("cx", "--engine", "codex", "--policy", "openai", "--prompt", "tidy up",
                               "-t", "greeting.txt")  # fmt: skip
        assert cx.returncode == 0, out(cx)
        wait_for(lambda: queue.state("sh") == "needs_review", 30, "sh to run")
        if queue.name == "file":
            wait_for(lambda: bool(queue.record("cx")["attempts"]), 30, "cx to be claimed")
        st = queue.fila("status")  # while the worker or runner is up
    assert st.returncode == 0, out(st)
    rec = queue.record("cx")
    assert rec["status"] == "queued", rec
    if queue.name == "pg":
        assert rec["attempts"] == [] and rec["attempt"] == 0
        assert "h1  live  engines shell" in st.stdout, st.stdout
        assert "waiting:  1 task: no live runner has engine codex (cx)" in st.stdout, st.stdout
    else:
        assert {a["outcome"] for a in rec["attempts"]} <= {"requeued", "handed back"}
        assert "image fila/codex:latest is not built" in rec["attempts"][0]["error"]["message"]
    assert queue.starts() == 1


@PG_BY_DEFAULT
def test_a_group_is_queued_whole_compared_reviewed_and_applying_one_member_supersedes_the_others(
    queue: Driver,
) -> None:
    # `--engine` repeated: one task per engine, ids GROUP.ENGINE, queued whole or not at all.
    group = ("--engine", "shell", "--engine", "codex", "--policy", "openai", "--command", "true",
             "--prompt", "tidy up", "-t", "greeting.txt")  # fmt: skip
    # --run returns once every member has its record, with run --once's exit codes:
    # here 2, as both are invalid (the fake backend runs no network allowlist, which policy
    # openai asks for).
    with queue.runs_submitted():
        ran = queue.submit_task("w", *group, "--run")
    assert ran.returncode == 2, out(ran)
    assert sorted(ln.split()[:2] for ln in ran.stdout.splitlines()) == [["w.codex", "failed"],
                                                                        ["w.shell", "failed"]]  # fmt: skip
    res = queue.submit_task("g", *group)
    assert res.returncode == 0 and res.stdout.split() == ["g.shell", "g.codex"], out(res)
    assert [queue.state(t) for t in ("g.shell", "g.codex")] == ["queued", "queued"]
    # h.shell is taken: the group h is refused whole, h.codex (queued first) with it.
    assert queue.submit("h.shell", "true").returncode == 0
    again = queue.submit_task("h", "--engine", "codex", "--engine", "shell", *group[4:])
    assert again.returncode == 4 and "h.shell" in again.stderr, out(again)
    assert queue.fila("show", "h.codex").returncode == 5  # nothing of the refused group was queued
    cmp = queue.fila("compare", "g", "--json")
    assert cmp.returncode == 0, out(cmp)
    assert [(r["id"], r["status"]) for r in json.loads(cmp.stdout)["rows"]] == [
        ("g.codex", "queued"), ("g.shell", "queued")]  # fmt: skip

    # A group of shell tasks given as task files with the same `group`; one fails, one waits.
    members = {"p1": "echo first >> greeting.txt", "p2": "echo second >> greeting.txt", "p3": "exit 3"}
    for tid, command in members.items():
        doc = {"engine": "shell", "command": command, "targets": ["greeting.txt"], "group": "pick",
               "check": "grep -q first greeting.txt"}  # fmt: skip
        assert queue.submit_file(tid, doc).returncode == 0
    queue.run_once()  # g's members fail here, as w's did
    assert queue.submit_file("p4", {**doc, "command": "echo fourth >> greeting.txt"}).returncode == 0
    assert [queue.state(t) for t in ("p1", "p2", "p3", "p4")] == ["needs_review", "needs_review",
                                                                  "failed", "queued"]  # fmt: skip
    table = queue.fila("compare", "pick")
    assert table.returncode == 0, out(table)
    lines = table.stdout.splitlines()
    assert lines[0] == "group pick: 4 tasks on greeting.txt" and lines[1].split()[-1] == "check"
    rows = {ln.split()[0]: ln for ln in lines[2:6]}
    assert "needs_review" in rows["p1"] and "+1 -0" in rows["p1"], table.stdout
    assert rows["p1"].rstrip().endswith("passed") and "failed (1)" in rows["p2"], table.stdout
    assert "failed" in rows["p3"] and "queued" in rows["p4"], table.stdout
    page = queue.fila("compare", "pick", "--html")
    assert page.returncode == 0 and "<td>p2</td>" in page.stdout, out(page)
    for name, said in (("nope", "no task in group 'nope'"), ("p1", "'p1' is a task of group 'pick'")):
        bad = queue.fila("compare", name)
        assert bad.returncode == 5 and said in bad.stderr, out(bad)

    # `fila review`: the verified diff, as text, JSON and a REVIEW.html the reviewer can open.
    rv = queue.fila("review", "p1", "--no-pager")
    assert rv.returncode == 0 and "+first" in rv.stdout and "task      p1  (needs_review)" in rv.stdout, out(
        rv
    )
    doc = json.loads(queue.fila("review", "p1", "--json").stdout)
    assert doc["verified"] and [f["path"] for f in doc["files"]] == ["greeting.txt"]
    page = queue.fila("review", "p1", "--html")
    assert page.returncode == 0 and page.stdout.strip() == str(queue.review_html("p1")), out(page)
    assert "+first" in queue.review_html("p1").read_text()

    # Applying p1 supersedes p2 and the failed p3; p4, still queued, is named and left.
    res = queue.fila("apply", "p1", "--yes", "--by", "alice", "--json")
    assert res.returncode == 0, out(res)
    got = json.loads(res.stdout)
    assert (got["superseded"], got["not_superseded"]) == (["p2", "p3"], ["p4"])
    for tid in ("p2", "p3"):
        rec = queue.record(tid)
        assert rec["status"] == "rejected" and rec["decision"]["action"] == "superseded"
        assert rec["decision"]["reason"] == "group pick: p1 was applied"
    bad = queue.fila("apply", "p2", "--yes", "--by", "bob")
    assert bad.returncode == 4 and "p2 was already superseded by alice" in bad.stderr, out(bad)
    assert queue.run_once().returncode == 0 and queue.state("p4") == "needs_review"
    bad = queue.fila("apply", "p4", "--yes", "--by", "bob")
    assert bad.returncode == 4 and "whose member p1 was applied by alice" in bad.stderr, out(bad)
    assert (queue.reviewer.path / "greeting.txt").read_text() == GREETING + "first\n"
    assert queue.fila("reject", "p4", "--by", "bob").returncode == 0  # a person may still drop it
