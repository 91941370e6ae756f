"""The run path of one task, from the claim to the published record, on the real Docker daemon:
the container's removal runs behind the diff and is awaited before the record is published, and a
failed removal is the same `needs_human` as before; one process asks the daemon its version once
and pings it at most once."""

from __future__ import annotations

import dataclasses
import os
import stat
import threading
import time
from pathlib import Path

import docker
import pytest

from fila.core.layout import Root
from fila.core.models import ImageRef, Status
from fila.queue import store as queue
from fila.run import attempts, intake
from fila.run import job as cycle
from fila.sandbox.docker import container as dk
from fila.sandbox.docker.backend import DockerBackend
from fila.workspace import diff
from tests.support.project import shell_task

S = Status
pytestmark = pytest.mark.docker


def left(client: docker.DockerClient, root: Root) -> tuple[list[str], list[str]]:
    """fila's containers and work volumes of this root, in any state."""
    flt = {"label": f"fila.root={root.path}"}
    return (
        [c.name for c in client.containers.list(all=True, filters=flt)],
        [v.name for v in client.volumes.list(filters=flt)],
    )


def claim_of(root: Root, tid: str, command: str):
    intake.submit(root, shell_task(command, id=tid))
    claim = cycle.next_claim(root, "w1", only={tid})
    assert claim is not None
    return claim


def test_the_diff_runs_while_the_container_is_removed_and_the_record_waits_for_the_removal(
    proj: Root, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    seen_at_publish: list[tuple[list[str], list[str]]] = []
    real_remove, real_diff, real_publish = dk.remove_exited, diff.compute_diff, queue.publish

    def slow_remove(*a, **kw):
        order.append("removal starts")
        time.sleep(1.0)  # a slow daemon: the diff must not wait for it
        real_remove(*a, **kw)
        order.append("removed")

    def watched_diff(*a, **kw):
        order.append(f"diff ({threading.current_thread().name})")
        return real_diff(*a, **kw)

    def watched_publish(*a, **kw):
        order.append("publish")
        seen_at_publish.append(left(docker_client, proj))
        return real_publish(*a, **kw)

    monkeypatch.setattr(dk, "remove_exited", slow_remove)
    monkeypatch.setattr(diff, "compute_diff", watched_diff)
    monkeypatch.setattr(queue, "publish", watched_publish)
    backend = DockerBackend()
    try:
        rec = cycle.run_one(proj, claim_of(proj, "t1", "sed -i s/hello/world/ greeting.txt"), backend=backend)
    finally:
        backend.close()
    assert rec is not None and rec.status == S.needs_review, rec
    assert rec.diffstat is not None and rec.diffstat.paths == ["greeting.txt"]
    # The diff began while the container was still being removed, in the job's own thread; the
    # record was published only after the removal ended, when nothing of the job was left.
    assert order[0] == "removal starts" and order[1].startswith("diff (") and "fila-remove" not in order[1]
    assert order[2:] == ["removed", "publish"], order
    assert seen_at_publish == [([], [])]
    t = rec.timings
    assert abs(t["create"] + t["start_wait"] + t["remove"] - t["run"]) <= 0.004, t
    assert abs(sum(t[k] for k in ("begin", "validate", "prepare", "run", "diff")) - t["total"]) <= 0.006, t


def test_a_removal_that_fails_behind_the_diff_is_the_needs_human_it_always_was(
    proj: Root, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Allowed first: the same task with a removal that works is ready for review.
    backend = DockerBackend()
    try:
        ok = cycle.run_one(proj, claim_of(proj, "t1", "echo world >> greeting.txt"), backend=backend)
        assert ok is not None and ok.status == S.needs_review

        real_remove = dk.remove_exited

        def failing_remove(client, spec, name, **kw):
            real_remove(client, spec, name, **kw)  # gone for real (nothing leaks from the test)
            err = docker.errors.APIError("the daemon failed to remove it (injected)")
            raise dk.docker_error(spec, f"removing container {name}", err) from err

        monkeypatch.setattr(dk, "remove_exited", failing_remove)
        rec = cycle.run_one(proj, claim_of(proj, "t2", "echo world >> greeting.txt"), backend=backend)
    finally:
        backend.close()
    assert rec is not None and rec.status == S.needs_human, rec
    assert rec.error is not None and rec.error.kind == "infra"
    assert "removing container fila-t2-" in rec.error.message and "(injected)" in rec.error.message
    assert rec.diagnosis and "docker failed while the container ran" in rec.diagnosis
    assert rec.patch_path is None, "no diff is offered for review from a job whose container may be left"
    assert left(docker_client, proj) == ([], [])
    assert not queue.claim_files(proj, "t2")


def test_one_process_asks_the_daemon_its_version_and_info_once_and_pings_it_at_most_once(
    proj: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run --once` of two tasks: the start-up check, each job's check and recovery's would each
    have been a ping (and every new client a GET /version); the daemon answering every request
    in between says the same. The overlay check's GET /info, asked in the background at the
    first claim, is asked once."""
    asked: list[str] = []
    real_send = __import__("requests").Session.send

    def counting_send(self, request, **kw):
        path = request.path_url.split("?")[0]
        if path.endswith(("/_ping", "/version", "/info")):
            asked.append(path.rsplit("/", 1)[1])
        return real_send(self, request, **kw)

    monkeypatch.setattr("requests.Session.send", counting_send)
    from fila.run.worker import Worker

    for tid in ("t1", "t2"):
        intake.submit(proj, shell_task("echo world >> greeting.txt", id=tid))
    recs: list = []
    w = Worker(proj, once=True, on_record=recs.append)
    assert w.run() == 0
    assert sorted(r.id for r in recs) == ["t1", "t2"] and {r.status for r in recs} == {S.needs_review}
    assert asked.count("version") == 1 and asked.count("info") == 1, asked
    assert asked.count("_ping") <= 1, asked
    assert {r.workspace.strategy for r in recs if r.workspace} == {"overlay"}, "the check was used"

    # Once the daemon fails a request, the next check asks it again.
    b = DockerBackend()
    try:
        b.ping()
        n = len(asked)
        b.ping()
        assert len(asked) == n, "it answered a moment ago"
        with pytest.raises(docker.errors.NotFound), b.client() as c:
            c.containers.get("fila-no-such-container-" + "0" * 8)
        b.ping()
        assert asked[n:] == ["_ping"], asked[n:]
    finally:
        b.close()


def test_an_empty_work_dir_is_made_inert_in_process_exactly_as_the_tools_make_a_full_one(
    tmp_path: Path,
) -> None:
    """An overlay job's work/ on the host is an empty mount point: reclaim sets its owner and
    strips its mode bits itself, the same result `find`, `chown` and `chmod` give a work/ with
    files in it (the path every copied job takes)."""
    from fila.workspace import handover

    owner = (os.getuid(), os.getgid())
    results = {}
    for kind in ("full", "empty"):
        job = tmp_path / kind
        (job / "work").mkdir(parents=True)
        if kind == "full":
            (job / "work" / "f.txt").write_text("x\n")
        if os.getuid() == 0:
            os.chown(job / "work", 65534, 65534)
        os.chmod(job / "work", 0o7777)
        warnings = handover.reclaim(job, owner=owner)
        st = os.lstat(job / "work")
        results[kind] = (
            stat.S_IMODE(st.st_mode),
            (st.st_uid, st.st_gid),
            [w.split(":")[0] for w in warnings],
        )
    assert results["full"] == (0o755, owner, ["setuid/setgid/sticky bits stripped in work/"]), results
    assert results["empty"] == results["full"]


def test_recovery_removes_a_work_volume_no_container_uses_and_never_one_in_use(
    proj: Root, docker_client: docker.DockerClient, shell_image: ImageRef
) -> None:
    """A process killed between its container's removal and its work volume's (now that the
    removal runs behind the diff, the window is the diff's length) leaves the volume alone."""
    from docker.types import Mount

    from fila.recovery import recover as recovery

    labels = {"fila": "1", "fila.root": str(proj.path), "fila.job": "t1"}
    docker_client.volumes.create(f"fila-t1-{os.urandom(4).hex()}-work", labels=labels)
    used = docker_client.volumes.create(
        f"fila-t2-{os.urandom(4).hex()}-work", labels={**labels, "fila.job": "t2"}
    )
    holder = docker_client.containers.create(
        shell_image.tag, ["true"], mounts=[Mount("/w", used.name, type="volume")], network_mode="none"
    )
    try:
        rep = recovery.recover(proj)
        assert left(docker_client, proj)[1] == [used.name], "the unused one went, the used one stayed"
        assert [a.task_id for a in rep.actions if a.action == "volume removed"] == ["t1"]
    finally:
        holder.remove(force=True)
    recovery.recover(proj)
    assert left(docker_client, proj) == ([], [])


def _break_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's wait connection breaks 1 s into the run (a restarting container engine)."""

    def broken_wait(self: dk.Waiter) -> None:
        time.sleep(1.0)
        self.error = docker.errors.APIError("the connection to the daemon was lost (injected)")
        self.done.set()

    monkeypatch.setattr(dk.Waiter, "run", broken_wait)


def test_a_failed_run_whose_container_cannot_be_removed_stays_fenced_until_recovery_sees_it_gone(
    proj: Root, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.core.errors import InfraError, InvalidTransition
    from fila.recovery.recover import recover

    _break_the_wait(monkeypatch)
    said: list[str] = []
    backend = DockerBackend()
    try:
        # Allowed first: the run fails and its container is removed: needs_human, claim released.
        ok = cycle.run_one(proj, claim_of(proj, "t1", "sleep 25"), backend=backend, progress=said.append)
        assert ok is not None and ok.status == S.needs_human, ok
        assert left(docker_client, proj) == ([], []) and not queue.claim_files(proj, "t1")

        def refused(client: docker.DockerClient, name: str) -> None:
            raise docker.errors.APIError("the daemon refused to remove the container (injected)")

        monkeypatch.setattr(dk, "remove_container", refused)
        with pytest.raises(InfraError) as err:
            cycle.run_one(proj, claim_of(proj, "t2", "sleep 25"), backend=backend, progress=said.append)
        # What the CLI prints on stderr (the worker prints the error and its hint).
        assert "could not remove container fila-t2-" in str(err.value), err.value
        assert "(injected)" in str(err.value) and "fila recover" in (err.value.hint or "")
        rec = queue.get_record(proj, "t2")
        assert rec.status == S.running, "never published as over while its engine may run"
        assert rec.error is not None and "could not remove container fila-t2-" in rec.error.message
        assert any("may still be running" in w for w in rec.warnings), rec.warnings
        assert [p.name.rsplit(".", 1)[1] for p in queue.claim_files(proj, "t2")] == ["reaped"]
        names, _ = left(docker_client, proj)
        assert len(names) == 1 and names[0].startswith("fila-t2-")
        with pytest.raises(InvalidTransition):
            queue.retry(proj, "t2", by="test")  # no second engine beside the first

        # Recovery while the daemon still refuses: undecided, nothing published.
        def refused_box(self: DockerBackend, box: object) -> bool:
            raise InfraError("the daemon refused to remove the container (injected)")

        monkeypatch.setattr(DockerBackend, "remove", refused_box)
        rep = recover(proj, backend=backend)
        assert [a.action for a in rep.actions if a.task_id == "t2"] == ["undecided"], rep.actions
        assert queue.get_record(proj, "t2").status == S.running
        monkeypatch.undo()
        rep = recover(proj, backend=backend)
        assert queue.get_record(proj, "t2").status == S.needs_human, rep.actions
        assert left(docker_client, proj) == ([], []) and not queue.claim_files(proj, "t2")
        decided = queue.get_record(proj, "t2")
        assert any("may still be running" in w for w in decided.warnings)
        # The run's own failure is what a person reads, not "the worker was lost".
        assert decided.error is not None and "(injected)" in decided.error.message, decided.error
        assert "could not be removed" in (decided.diagnosis or ""), decided.diagnosis
        assert "worker was lost" not in (decided.diagnosis or ""), decided.diagnosis
    finally:
        backend.close()
        for c in docker_client.containers.list(all=True, filters={"label": f"fila.root={proj.path}"}):
            c.remove(force=True)


def test_a_retry_never_starts_while_a_container_of_an_earlier_attempt_is_there(
    proj: Root, docker_client: docker.DockerClient, shell_image: ImageRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.core.errors import InfraError
    from fila.queue import retry

    # No backoff: the requeued task is claimable at once.
    monkeypatch.setattr(retry, "INFRA", dataclasses.replace(retry.INFRA, base=0.0))

    backend = DockerBackend()
    try:
        first = cycle.run_one(proj, claim_of(proj, "t1", "exit 7"), backend=backend)
        assert first is not None and first.status == S.failed and first.exit_code == 7
        queue.retry(proj, "t1", by="test")
        # An earlier attempt's engine, still there (its removal failed and no recovery ran yet).
        stale = docker_client.containers.run(
            shell_image.tag,
            ["sleep", "60"],
            detach=True,
            network_mode="none",
            labels={"fila": "1", "fila.job": "t1", "fila.root": str(proj.path), "fila.worker": "gone-1-x"},
        )
        claim = cycle.next_claim(proj, "w1", only={"t1"})
        assert claim is not None
        with pytest.raises(InfraError, match="of an earlier attempt is still there"):
            cycle.run_one(proj, claim, backend=backend)
        assert left(docker_client, proj)[0] == [stale.name], "no second container was made"
        rec = queue.get_record(proj, "t1")
        assert rec.status == S.queued and rec.attempts[-1].outcome == "requeued"
        # Allowed: once it is gone, the retry runs.
        stale.remove(force=True)
        claim = cycle.next_claim(proj, "w1", only={"t1"})
        assert claim is not None
        rec2 = cycle.run_one(proj, claim, backend=backend)
        assert rec2 is not None and rec2.attempt == 3 and rec2.exit_code == 7, "the engine ran"
    finally:
        backend.close()
        for c in docker_client.containers.list(all=True, filters={"label": f"fila.root={proj.path}"}):
            c.remove(force=True)


def test_an_output_stream_that_outlives_the_container_is_cut_off_and_said_so_not_abandoned(
    proj: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    command = "echo first-line; sleep 0.3; echo LAST-LINE-OF-OUTPUT; echo world > greeting.txt"
    seen: list[bool] = []
    real_classify = attempts._classify

    def watched(engine, result, log_path, checked):  # what classification is told of stdout
        seen.append(result.output.stdout_truncated)
        return real_classify(engine, result, log_path, checked)

    monkeypatch.setattr(attempts, "_classify", watched)
    monkeypatch.setattr(dk, "PUMP_WAIT_S", 1.0)  # 10 s in use
    backend = DockerBackend()
    try:
        # Allowed first: a stream that ends with the container: whole log, whole stdout, no warning.
        ok = cycle.run_one(proj, claim_of(proj, "t1", command), backend=backend)
        assert ok is not None and ok.status == S.needs_review
        assert b"LAST-LINE-OF-OUTPUT" in proj.log_path("t1").read_bytes()
        assert seen == [False] and not [w for w in ok.warnings if "log" in w]

        real_frames = dk.log_frames

        def slow(client, cid, **kw):  # a busy daemon: what follows the first frame comes late
            for n, item in enumerate(real_frames(client, cid, **kw)):
                if n and kw.get("follow", True):
                    time.sleep(12)
                yield item

        monkeypatch.setattr(dk, "log_frames", slow)
        rec = cycle.run_one(proj, claim_of(proj, "t2", command), backend=backend)
    finally:
        backend.close()
    assert rec is not None
    assert [w for w in rec.warnings if w.startswith("log incomplete")], rec.warnings
    assert seen == [False, True], "classification is told stdout is a part"
    log = proj.log_path("t2").read_bytes()
    assert b"first-line" in log and b"LAST-LINE-OF-OUTPUT" not in log
    assert log.rstrip().endswith(b"may miss the end of its output]")


def test_a_stream_blocked_on_its_socket_is_ended_by_the_cut_and_its_thread_stops(
    proj: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    monkeypatch.setattr(dk, "PUMP_WAIT_S", 1.0)
    real_frames = dk.log_frames

    def stuck(client, cid, **kw):  # the first frame, then a read that never returns by itself
        frames = real_frames(client, cid, **kw)
        if not kw.get("follow", True):
            yield from frames
            return
        yield next(frames)
        frames.close()
        mine, other = socket.socketpair()
        kw["opened"](mine)
        assert mine.recv(1) == b""  # blocks until the cut shuts the socket
        other.close()

    backend = DockerBackend()
    try:
        # Allowed first: the stream that ends by itself leaves no thread behind either.
        ok = cycle.run_one(proj, claim_of(proj, "b1", "echo a; sleep 0.3; echo b"), backend=backend)
        assert ok is not None and not [w for w in ok.warnings if w.startswith("log incomplete")]
        assert not [t for t in threading.enumerate() if t.name == "fila-log-b1.log"]
        monkeypatch.setattr(dk, "log_frames", stuck)
        rec = cycle.run_one(proj, claim_of(proj, "b2", "echo a; sleep 0.3; echo b"), backend=backend)
    finally:
        backend.close()
    assert rec is not None and [w for w in rec.warnings if w.startswith("log incomplete")]
    assert not [t for t in threading.enumerate() if t.name == "fila-log-b2.log"], "the cut ended it"


def test_the_log_and_the_events_file_are_on_disk_before_the_record_that_points_at_them(
    proj: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync, real_publish = os.fsync, queue.publish

    def watched_fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    def watched_publish(*a, **kw):
        synced.append("publish")
        return real_publish(*a, **kw)

    monkeypatch.setattr(os, "fsync", watched_fsync)
    monkeypatch.setattr(queue, "publish", watched_publish)
    logs = str(proj.logs_dir)
    events = str(proj.logs_dir / "t1.events.jsonl")
    backend = DockerBackend()
    try:
        claim = claim_of(proj, "t1", "echo world >> greeting.txt")
        # The submit created the events file: its line and then its directory entry are synced.
        assert events in synced and logs in synced[synced.index(events) :], synced
        # Allowed counterpart: an append to a file that exists already syncs the file only.
        synced.clear()
        queue.log_event(proj, "t1", "test")
        assert synced == [events], synced
        synced.clear()
        rec = cycle.run_one(proj, claim, backend=backend)
    finally:
        backend.close()
    assert rec is not None and rec.status == S.needs_review
    log = str(proj.log_path("t1"))
    before = synced[: synced.index("publish")]
    assert log in before, f"the log is fsynced before the record: {synced}"
    assert logs in before, "and the logs directory after the log was made"
