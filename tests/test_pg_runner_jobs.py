"""A PostgreSQL runner's jobs (docs/scale-out.md, "Running it"): each claim's job root is held by a
lock for the job's life, and the job roots of a runner that died are recovered (containers,
gateway, directory) at the next runner's start and by `fila recover --root`, never a live
runner's; a runner whose remote/ is unusable refuses to start, and one whose remote/ breaks hands
its claim back uncounted; `--once` waits out a backoff of a task it could claim; `--concurrency N`
runs N claims at once. Real PostgreSQL (tests/support/pg.py), the fake backend, and one test with Docker. Each
refused case shows its allowed counterpart first.

Cost in the default run: about 9 s for the fake backend's cases (a 1.5 s backoff waited out, two
jobs held at a file barrier until both run, then a third, a runner process stopped by SIGTERM,
two short runs whose second cannot remove its box, four short `--once` runs) and about 8-10 s for
the Docker case (a runner process, two runners and a recovery in this process, a 3 s lease that
lapses)."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from fila.core.layout import Root
from fila.core.models import ImageRef, Status, Task
from fila.queue.pg.store import PgQueue
from tests.support.pg_runner import events, fila, host_env, start_worker
from tests.support.project import make_project, make_root
from tests.support.queues import wait_for

S = Status


@pytest.fixture
def sub(tmp_path: Path) -> Root:
    """The submitting host's queue root, its project holding greeting.txt."""
    return make_project(tmp_path / "submitter", {})


def submit(url: str, sub: Root, tid: str, command: str) -> None:
    res = fila("submit", "--queue", url, "--root", str(sub.path), "--id", tid, "--engine", "shell",
               "--command", command, "-t", "greeting.txt")  # fmt: skip
    assert res.exit_code == 0 and res.output.strip() == tid, res.output


def wait(pred: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_a_free_job_root_is_recovered_with_its_container_and_a_held_one_is_never_touched(
    tmp_path: Path,
) -> None:
    from fila.recovery import remote_jobs, runner_root
    from fila.recovery.recover import recover, recover_job_roots
    from fila.sandbox.fake import FakeBackend

    runner = make_root(tmp_path / "runner")
    fake = FakeBackend(tmp_path / "boxes")
    jobs = {}
    for name in ("a.1", "b.2"):  # two job roots, each with the box of a container still there
        held = remote_jobs.take(runner, name)
        jr = Root(runner_root.jobs_dir(runner) / name).create()
        fake.leave(name.split(".")[0], root=str(jr.path), worker="h1")
        jobs[name] = (held, jr)
    # A second taker of the same claim's lock is refused (a lock is never replaced), and so is a
    # directory there without its lock (a project's own): not a runner's, never touched.
    from fila.core.errors import InfraError

    with pytest.raises(InfraError, match="exists already"):
        remote_jobs.take(runner, "a.1")
    mine = runner_root.jobs_dir(runner) / "v1.2"
    (mine / "fila" / "in").mkdir(parents=True)
    with pytest.raises(InfraError, match="exists without its lock"):
        remote_jobs.take(runner, "v1.2")

    # The allowed counterpart: held locks (a live runner's jobs) are left alone, by a runner's
    # start and by `fila recover`; the directory without its lock is only said, by its path.
    kept = recover_job_roots(runner, backend=fake).actions
    assert [(a.action, a.detail.split(":")[0]) for a in kept] == [("job root kept", str(mine))]
    assert recover(runner, backend=fake).containers_removed == []
    assert all(jr.path.is_dir() for _held, jr in jobs.values()) and len(fake.find()) == 2

    # a.1's runner is gone (its lock let go, as the kernel does for a killed process): its box
    # and job root go, b.1's stay.
    jobs["a.1"][0].release()
    rep = recover(runner, backend=fake)
    assert len(rep.containers_removed) == 1, rep.to_dict()
    assert [a.action for a in rep.actions if a.task_id is None] == ["job root removed", "job root kept"]
    assert not jobs["a.1"][1].path.exists() and jobs["b.2"][1].path.is_dir()
    assert [b.labels["fila.job"] for b in fake.find()] == ["b"]
    assert sorted(p.name for p in runner_root.jobs_dir(runner).iterdir()) == [".b.2.lock", "b.2", "v1.2"]
    jobs["b.2"][0].release()
    assert len(recover_job_roots(runner, backend=fake).containers_removed) == 1
    assert [p.name for p in runner_root.jobs_dir(runner).iterdir()] == ["v1.2"] and fake.find() == []
    assert (mine / "fila" / "in").is_dir()


def test_a_job_whose_container_could_not_be_removed_keeps_its_job_root_for_recovery(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path
) -> None:
    from fila.core.errors import InfraError
    from fila.recovery import remote_jobs
    from fila.recovery.recover import recover
    from fila.run.remote import RemoteWorker
    from fila.sandbox.fake import FakeBackend
    from fila.sandbox.fake_job import Act

    runner = make_root(tmp_path / "h1")
    # The engine cannot remove f's box after its run: the run path fences the job off.
    stuck = {"f": Act(files={"greeting.txt": "changed"}, error=InfraError("timed out"), error_at="remove")}

    def once() -> RemoteWorker:
        return RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], once=True,
                            backend=FakeBackend(tmp_path / "boxes", script=stuck), poll_s=0.2)  # fmt: skip

    # The allowed counterpart: a job whose box goes leaves nothing in remote/.
    submit(pg_url, sub, "ok", "echo ok >> greeting.txt")
    w = once()
    assert w.run() == 0 and [r.id for r in w.records] == ["ok"]
    assert list((runner.path / "remote").iterdir()) == []
    submit(pg_url, sub, "f", "echo f >> greeting.txt")
    w = once()
    assert w.run() == 3 and isinstance(w.infra_error, InfraError), w.infra_error
    # Its job root stays, its lock free, beside the box that names it (never an orphan's label).
    jr = runner.path / "remote" / f"f.{q.task_state('f')['token']}"
    boxes = FakeBackend(tmp_path / "boxes")
    assert jr.is_dir() and [b.labels["fila.root"] for b in boxes.find()] == [str(jr)]
    with remote_jobs.free(runner, jr.name) as nonce:
        assert nonce is not None and remote_jobs.proven(jr, nonce)
    rep = recover(runner, backend=boxes)
    assert [a.action for a in rep.actions if a.task_id is None] == ["job root removed"], rep.to_dict()
    assert boxes.find() == [] and list((runner.path / "remote").iterdir()) == []
    # A long-running runner recovers what it kept while it runs, not only at its next start.
    submit(pg_url, sub, "g", "echo g >> greeting.txt")
    said: list[str] = []
    slow = FakeBackend(tmp_path / "boxes", script={"g": stuck["f"]})
    w = RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], poll_s=0.2, recover_every_s=0.3,
                     backend=slow, progress=said.append)  # fmt: skip
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: any("job root removed" in m for m in said), 20, "the kept job root's recovery")
        assert boxes.find() == [] and list((runner.path / "remote").iterdir()) == []
    finally:
        w.cancel.set()
        w.wake.set()
        t.join(20)
    assert not t.is_alive()


def test_once_waits_out_the_backoff_of_a_task_it_can_claim_and_leaves_those_it_cannot(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path
) -> None:
    from fila.run.remote import RemoteWorker
    from fila.sandbox.fake import FakeBackend

    # A task for an engine this runner does not take: `--once` does not wait for it (the allowed
    # counterpart of the wait below: nothing it could run is left).
    q.enqueue("cx", Task(engine="codex", targets=["greeting.txt"], prompt="tidy up"))
    runner = make_root(tmp_path / "h1")

    def once() -> RemoteWorker:
        return RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], once=True,
                            backend=FakeBackend(tmp_path / "h1.boxes"), poll_s=0.2)  # fmt: skip

    w = once()
    assert w.run() == 0 and w.records == []
    # A task of its engine handed back with a backoff (as after an infra error): waited for.
    submit(pg_url, sub, "b", "echo b >> greeting.txt")
    lease = q.claim("h0", ["shell"], 30)
    t0 = time.monotonic()  # before the backoff starts: a run that waits it out takes >= 1.5 s
    assert lease is not None and q.hand_back("b", lease.token, None, backoff_s=1.5) is not None
    w = once()
    assert w.run() == 0, w.infra_error
    assert time.monotonic() - t0 >= 1.0  # it waited, rather than exit with b queued
    assert [r.id for r in w.records] == ["b"] and q.get("b").status == S.needs_review
    assert q.get("cx").status == S.queued


def _overlap(q: PgQueue, tids: list[str]) -> int:
    """The most tasks of `tids` between their started mark and their publish at one moment, on
    the database's clock."""
    spans: list[tuple[datetime, int]] = []
    for tid in tids:
        [start] = events(q, tid, "container started")
        [end] = events(q, tid, "published")
        spans += [(datetime.fromisoformat(start["at"]), 1), (datetime.fromisoformat(end["at"]), -1)]
    most = now = 0
    for _at, step in sorted(spans):  # an end before a start at the same instant
        now += step
        most = max(most, now)
    return most


def test_a_runner_with_concurrency_runs_that_many_claims_at_once_and_sigterm_stops_them_all(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path
) -> None:
    from fila.run.remote import RemoteWorker
    from fila.sandbox.fake import FakeBackend

    runner = make_root(tmp_path / "h1")
    tids = [f"c{i}" for i in range(3)]
    # A barrier: each job leaves its marker, then waits (at most 30 s) until two markers exist.
    # The first two can end only once both have started, so they overlap whatever the load;
    # the third finds two markers and does not wait.
    gate = tmp_path / "gate"
    gate.mkdir()
    wait_two = f"n=0; while set -- {gate}/*; [ $# -lt 2 ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n+1)); done"
    for i, tid in enumerate(tids):
        submit(pg_url, sub, tid, f": > {gate}/{tid}; {wait_two}; echo {i} >> greeting.txt")
    said: list[str] = []
    w = RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], once=True, concurrency=2,
                     backend=FakeBackend(tmp_path / "h1.boxes"), poll_s=0.2,
                     progress=said.append)  # fmt: skip
    assert w.run() == 0, said
    assert sorted(r.id for r in w.records) == tids
    for tid in tids:  # each once, with its own claim
        assert q.get(tid).status == S.needs_review
        assert len(events(q, tid, "claimed")) == 1 and len(events(q, tid, "published")) == 1
    assert len({e["token"] for t in tids for e in events(q, t, "claimed")}) == 3
    assert sorted(p.name for p in gate.iterdir()) == tids  # each passed the barrier
    assert _overlap(q, tids) == 2  # two at once (the barrier), never three
    [row] = q.runners(60)
    assert row["slots"] == 2
    assert list((runner.path / "remote").iterdir()) == []  # every job root and lock gone

    # SIGTERM stops every job at once: containers stopped, each started task a person's.
    for tid in ("l1", "l2"):
        submit(pg_url, sub, tid, "sleep 60")
    p = start_worker(pg_url, runner.path, "h1", "--concurrency", "2", "--poll", "0.2",
                     env=host_env(tmp_path, "h1"))  # fmt: skip
    try:
        wait(lambda: all(q.task_state(t)["started"] for t in ("l1", "l2")))
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, (tmp_path / "h1.err").read_text()
    finally:
        p.kill()
        p.wait(10)
    assert FakeBackend(tmp_path / "h1.boxes").find() == []
    for tid in ("l1", "l2"):
        rec = q.get(tid)
        assert rec.status == S.needs_human and rec.error is not None, tid
        assert rec.error.kind == "interrupted", rec.error
    assert list((runner.path / "remote").iterdir()) == []


@pytest.mark.docker
def test_a_runner_sigkilled_mid_job_leaves_its_container_to_the_next_runner_and_a_live_ones_alone(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path, shell_image: ImageRef, docker_client: Any
) -> None:
    runner = make_root(tmp_path / "runner")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FILA_", "PG"))}
    submit(pg_url, sub, "k", "sleep 60")
    p = start_worker(pg_url, runner.path, "d1", "--engine", "shell", "--lease", "3", "--poll", "0.2",
                     env=env)  # fmt: skip
    try:
        wait(lambda: q.task_state("k")["started"])
        jr = runner.path / "remote" / f"k.{q.task_state('k')['token']}"

        def boxes() -> list[Any]:
            return docker_client.containers.list(all=True, filters={"label": [f"fila.root={jr}"]})

        wait(lambda: [c.status for c in boxes()] == ["running"])
        # The allowed counterpart: a live runner's job root and container survive another runner's
        # start on the same root and a `fila recover` there.
        other = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "d2", "--once",
                     "--engine", "shell", env={"FILA_BACKEND": None})  # fmt: skip
        assert other.exit_code == 0, other.output
        res = fila("recover", "--root", str(runner.path), env={"FILA_BACKEND": None})
        assert res.exit_code == 0 and "job root" not in res.output, res.output
        assert jr.is_dir() and [c.status for c in boxes()] == ["running"]
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        p.kill()
    assert jr.is_dir() and len(boxes()) == 1  # what the killed runner left
    wait(lambda: q.task_state("k")["lease_expires_at"] <= q.clock(), 30)
    again = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "d1", "--once",
                 "--engine", "shell", env={"FILA_BACKEND": None})  # fmt: skip
    assert again.exit_code == 0, again.output
    assert f"job root removed: {jr}" in again.output, again.output
    assert boxes() == [] and not jr.exists() and list((runner.path / "remote").iterdir()) == []
    rec = q.get("k")  # decided by its lease (the restarted runner's sweep), run once
    assert rec.status == S.needs_human and len(events(q, "k", "container started")) == 1
    assert events(q, "k", "published") == []
    res = fila("retry", "k", "--queue", pg_url, "--by", "carol")
    assert res.exit_code == 0 and q.get("k").status == S.queued, res.output


def test_a_runner_whose_remote_is_unusable_refuses_to_start_and_hands_a_claim_back_uncounted(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path
) -> None:
    from fila.run.remote import RemoteWorker
    from fila.sandbox.fake import FakeBackend

    runner = make_root(tmp_path / "h1")
    remote = runner.path / "remote"
    env = host_env(tmp_path, "h1")
    args = ("worker", "--queue", pg_url, "--root", str(runner.path), "--once", "--engine", "shell")
    # The allowed counterpart: remote/ usable, the task runs.
    submit(pg_url, sub, "a", "echo a >> greeting.txt")
    res = fila(*args, env=env)
    assert res.exit_code == 0 and q.get("a").status == S.needs_review, res.output
    # remote/ a project's file: the runner refuses to start (exit 3, what to do), nothing claimed.
    submit(pg_url, sub, "r", "echo r >> greeting.txt")
    remote.rmdir()
    remote.write_text("a project's file")
    res = fila(*args, env=env)
    assert res.exit_code == 3 and "not a directory of this user's" in res.output, res.output
    assert (q.task_state("r")["state"], q.task_state("r")["tries"]) == ("queued", 0)
    # remote/ broken after the start (at the claim): the task is handed back uncounted, the
    # `--once` runner stops with exit 3; its error names no path of this host.
    remote.unlink()

    def breaks(msg: str) -> None:
        if "claimed" in msg and remote.is_dir():
            remote.rmdir()
            remote.write_text("a project's file")

    w = RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], once=True,
                     backend=FakeBackend(tmp_path / "h1.boxes"), poll_s=0.1, progress=breaks)  # fmt: skip
    assert w.run() == 3 and w.records == [] and w.infra_error is not None
    st, err = q.task_state("r"), q.get("r").error
    assert (st["state"], st["tries"]) == ("queued", 0)
    assert err is not None and err.kind == "infra" and err.message.startswith("<runner>/remote "), err
    remote.unlink()
    res = fila(*args, env=env)
    assert res.exit_code == 0 and q.get("r").status == S.needs_review, res.output
