"""Runners of the PostgreSQL queue (docs/scale-out.md): `fila submit --queue` sends a task and its
targets, `fila worker --queue` on a "host" (its own local root, host id and container engine
state) claims it, runs it through the one run path and publishes its record and blobs, and `ls`,
`show` and `diff --queue` read them back from anywhere. Real PostgreSQL (tests/support/pg.py),
the fake backend for the cycle (no containers), and one test with Docker. Each refused case
shows its allowed counterpart first. The cycle, `submit --run` and a runner killed before and
after its container started are tests/test_queue_acceptance.py's, the same tests the file queue
passes."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fila.core.layout import Root
from fila.core.models import ImageRef, Status, Task
from fila.queue.pg.store import INPUTS, PgQueue
from tests.support.pg import clear_backoff
from tests.support.pg_runner import events, fila, host_env, start_worker
from tests.support.project import make_project, make_root

S = Status
BIG = {"max_files": 1000, "max_bytes": 1 << 20}  # unpack's limits where they are not the point


@pytest.fixture
def sub(tmp_path: Path) -> Root:
    """The submitting host's queue root, its project holding greeting.txt and src/."""
    return make_project(tmp_path / "submitter", {"src/a.py": "x = 1\n", "src/b.py": "y = 2\n"})


def submit(url: str, sub: Root, tid: str, command: str, *targets: str) -> None:
    flags = [x for t in targets or ("greeting.txt",) for x in ("-t", t)]
    res = fila("submit", "--queue", url, "--root", str(sub.path), "--id", tid, "--engine", "shell",
               "--command", command, *flags)  # fmt: skip
    assert res.exit_code == 0, res.output
    assert res.output.strip() == tid


def test_a_task_submitted_to_the_database_is_run_by_a_runner_and_reviewed_from_anywhere(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    submit(pg_url, sub, "t1", "echo bye >> greeting.txt; echo 3 > src/c.py", "greeting.txt", "src")
    assert q.get("t1").status == S.queued
    sent = events(q, "t1", "submitted")[0]["inputs"]
    assert sent == {"blobs": 4, "sent": 4, "bytes_sent": sent["bytes_sent"]} and sent["bytes_sent"] > 0
    # The same contents again under another id: the database has them, nothing is sent again.
    submit(pg_url, sub, "t2", "true", "greeting.txt", "src")
    assert events(q, "t2", "submitted")[0]["inputs"] == {"blobs": 4, "sent": 0, "bytes_sent": 0}
    submit(pg_url, sub, "bad", "exit 3")  # an engine that fails: its error says where its log is

    runner = make_root(tmp_path / "runner")
    for k, v in host_env(tmp_path, "h1").items():
        monkeypatch.setenv(k, v)
    res = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once")
    assert res.exit_code == 1, res.output  # bad failed
    # Each claim is said once, as the lease is taken, with its token.
    claimed = [line for line in res.output.splitlines() if ": claimed" in line]
    assert len(claimed) == 3 and {line.split(":")[0] for line in claimed} == {"t1", "t2", "bad"}, res.output
    assert all(re.fullmatch(r"\w+: claimed \(attempt 1, token \d+\)", line) for line in claimed), claimed
    bad = q.get("bad")  # the runner's job root is gone: the log is the published one, read by its id
    assert bad.status == S.failed and bad.error is not None and bad.error.kind == "engine_error"
    assert bad.error.message.endswith("; see `fila logs bad --queue URL`"), bad.error.message
    assert bad.attempts[-1].error == bad.error and "remote" not in bad.model_dump_json()
    rec = q.get("t1")
    assert rec.status == S.needs_review and rec.worker == "h1" and rec.container_started
    assert rec.diffstat is not None and rec.diffstat.files == 2
    [ran] = rec.attempts  # the runner's view of its engine, the queue's number, claim and runner
    assert (ran.number, ran.run, ran.worker, ran.engine, ran.outcome) == (1, 1, "h1", "shell", "success")
    assert ran.ended_at is not None and ran.exit_code == 0 and ran.log_path == "log"
    t2 = q.get("t2")
    assert t2.status == S.needs_review and t2.diffstat is not None and t2.diffstat.files == 0
    blobs = q.task_blobs("t1")
    assert set(blobs) == {"DIFF.patch", "log", INPUTS, "events.jsonl"}
    patch = q.blob(blobs["DIFF.patch"])
    assert hashlib.sha256(patch).hexdigest() == rec.patch_sha256 and b"+bye" in patch
    assert (runner.path / "remote").exists() and not any((runner.path / "remote").iterdir())
    assert not (sub.path / "greeting.txt").read_text().endswith("bye\n")  # the project is untouched

    # Review from anywhere: no root, only the URL.
    monkeypatch.chdir(tmp_path)
    listed = fila("ls", "--queue", pg_url)
    assert (
        listed.exit_code == 0 and "t1  needs_review" in listed.output and "t2  needs_review" in listed.output
    )
    shown = fila("show", "t1", "--queue", pg_url)
    assert shown.exit_code == 0, shown.output
    assert f"blob:      DIFF.patch sha256 {rec.patch_sha256}" in shown.output
    diff = fila("diff", "t1", "--queue", pg_url)
    assert diff.exit_code == 0 and diff.stdout_bytes == patch
    # A DIFF.patch blob that is not the patch the record names (changed in the database) is refused.
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE fila_task_blobs SET sha256 = %s WHERE task_id = 't1' AND name = 'DIFF.patch'",
                     (blobs[INPUTS],))  # fmt: skip
    swapped = fila("diff", "t1", "--queue", pg_url)
    assert swapped.exit_code != 0 and f"its record names {rec.patch_sha256}" in swapped.output


def test_a_queue_url_with_a_password_or_an_unmigrated_database_is_refused_with_what_to_do(
    pg_url: str, pg_cluster: Any, tmp_path: Path
) -> None:
    assert fila("ls", "--queue", pg_url).exit_code == 0  # the allowed counterpart: migrated, no password
    bare = pg_cluster.new_database()
    res = fila("ls", "--queue", bare)
    assert res.exit_code != 0 and "has schema version 0" in res.output and "fila queue init" in res.output
    nowhere = f"postgresql:///fila?host={tmp_path / 'no-server'}&user=fila"
    res = fila("ls", "--queue", nowhere)
    assert res.exit_code == 3 and f"fila@{tmp_path / 'no-server'}:5432/fila does not answer" in res.output
    res = fila("ls", "--queue", "postgresql://fila:s3cret@localhost/fila")
    assert res.exit_code != 0 and "password" in res.output and "s3cret" not in res.output
    runner = make_root(tmp_path / "h1")
    res = fila("worker", "--queue", bare, "--root", str(runner.path), "--once", env={"FILA_BACKEND": "fake",
               "FILA_FAKE_DIR": str(tmp_path / "boxes")})  # fmt: skip
    assert res.exit_code != 0 and "has schema version 0" in res.output


def test_a_targets_upload_over_the_policy_limits_is_refused_and_nothing_is_written(
    pg_url: str, q: PgQueue, sub: Root
) -> None:
    submit(pg_url, sub, "ok", "true", "src")  # the allowed counterpart: within the limits
    policy = sub.policies_dir / "default.json"
    doc = json.loads(policy.read_text())
    policy.write_text(json.dumps({**doc, "max_work_bytes": 8}))
    res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", "big", "--engine", "shell",
               "--command", "true", "-t", "src")  # fmt: skip
    assert res.exit_code != 0 and "max_work_bytes 8" in res.output, res.output
    assert [r.id for r in q.listing()[0]] == ["ok"]
    assert not list(sub.jobs_dir.iterdir()) and not list(sub.meta_dir.iterdir())  # no scratch left


def test_a_manifest_that_escapes_the_job_or_a_tampered_blob_fails_the_task_and_lays_nothing_out(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.core.errors import InvalidInput
    from fila.queue.pg.errors import BlobMismatch
    from fila.run.remote_inputs import read_manifest, unpack

    def manifest(*entries: dict[str, Any]) -> bytes:
        return json.dumps({"version": 1, "targets": ["a"], "entries": list(entries)}).encode()

    data = b"hello\n"
    sha = hashlib.sha256(data).hexdigest()

    class Source:
        def blob(self, sha256: str) -> bytes:
            return {sha: data}[sha256]

    good = {"path": "a/x.txt", "kind": "file", "size": 6, "sha256": sha, "mode": 0o644}
    assert unpack(Source(), manifest(good), tmp_path / "ok", **BIG) == ["a"]  # the allowed counterpart
    assert (tmp_path / "ok" / "a" / "x.txt").read_bytes() == data
    for bad, why in [
        ({**good, "path": "../x"}, "not a plain relative path"),
        ({**good, "path": "/etc/x"}, "not a relative path"),
        ({**good, "path": "policies/default.json"}, "keeps for itself"),
    ]:
        with pytest.raises(InvalidInput, match=why):
            read_manifest(manifest(bad))
    link = {"path": "a/l", "kind": "symlink", "size": 4, "sha256": sha, "mode": 0o777}
    with pytest.raises(InvalidInput, match="under the symlink"):
        read_manifest(manifest(link, {**good, "path": "a/l/x.txt"}))
    with pytest.raises(InvalidInput, match="cannot be laid out"):  # a file where a directory must be
        unpack(Source(), manifest({**good, "path": "a"}, good), tmp_path / "twice", **BIG)
    with pytest.raises(BlobMismatch, match="the manifest says 7"):
        unpack(Source(), manifest({**good, "size": 7}), tmp_path / "bad", **BIG)

    # Through a runner: a task whose manifest was swapped in the database fails, no container.
    import psycopg

    submit(pg_url, sub, "swapped", "true")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        greeting = hashlib.sha256(b"hello\n").hexdigest()
        conn.execute("UPDATE fila_task_blobs SET sha256 = %s WHERE task_id = 'swapped'", (greeting,))
    runner = make_root(tmp_path / "h1")
    for k, v in host_env(tmp_path, "h1").items():
        monkeypatch.setenv(k, v)
    res = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once")
    assert res.exit_code == 2, res.output  # as `run --once`: the one task was invalid
    rec = q.get("swapped")
    assert rec.status == S.failed and rec.error is not None and not rec.container_started
    assert rec.error.kind == "invalid" and "the task's input manifest: not JSON" in rec.error.message


def test_two_runner_hosts_drain_the_queue_and_each_task_runs_exactly_once(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path
) -> None:
    n = 6
    for i in range(n):
        submit(pg_url, sub, f"d{i}", f"echo {i} >> greeting.txt")
    hosts = {h: make_root(tmp_path / h) for h in ("h1", "h2")}
    procs = [start_worker(pg_url, r.path, h, "--once", env=host_env(tmp_path, h)) for h, r in hosts.items()]
    for p in procs:
        assert p.wait(120) == 0, (tmp_path / "h1.err").read_text() + (tmp_path / "h2.err").read_text()
    ran: dict[str, str] = {}
    for i in range(n):
        rec = q.get(f"d{i}")
        assert rec.status == S.needs_review and rec.attempt == 1
        assert len(events(q, f"d{i}", "claimed")) == 1 and len(events(q, f"d{i}", "published")) == 1
        assert len(events(q, f"d{i}", "container started")) == 1
        assert f"+{i}\n".encode() in q.blob(q.task_blobs(f"d{i}")["DIFF.patch"])
        ran[f"d{i}"] = rec.worker or ""
    assert set(ran.values()) <= {"h1", "h2"}


def _wait(pred: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_a_runner_renews_its_lease_and_one_that_loses_it_stops_its_container_and_publishes_nothing(
    pg_url: str, q: PgQueue, pg_cluster: Any, sub: Root, tmp_path: Path
) -> None:
    from fila.sandbox.fake import FakeBackend
    from tests.support.pgproxy import Proxy

    runner = make_root(tmp_path / "h1")
    # The allowed counterpart: a job that outlives its first lease (3 s) keeps it by renewal.
    submit(pg_url, sub, "long", "sleep 4; echo done >> greeting.txt")
    p = start_worker(pg_url, runner.path, "h1", "--once", "--lease", "3", env=host_env(tmp_path, "h1"))
    assert p.wait(60) == 0, (tmp_path / "h1.err").read_text()
    assert q.get("long").status == S.needs_review

    # The lease taken while the container runs (it expired and a sweep decided): the runner's next
    # renewal is refused, it stops its container and publishes nothing.
    submit(pg_url, sub, "taken", "sleep 60")
    p = start_worker(pg_url, runner.path, "h1", "--once", "--lease", "3", env=host_env(tmp_path, "h1"))
    try:
        _wait(lambda: q.task_state("taken")["started"])
        import psycopg

        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("UPDATE fila_tasks SET lease_expires_at = now() WHERE id = 'taken'")
        assert q.sweep() == [("taken", S.needs_human)]
        # Stopped at its next renewal (every 1 s) and check, not after the job's 60 s: the bound
        # is half of that, so a loaded machine's slow second does not fail it.
        assert p.wait(30) == 0, (tmp_path / "h1.err").read_text()
    finally:
        p.kill()
    assert FakeBackend(tmp_path / "h1.boxes").find(job_id="taken") == []  # its container is gone
    assert events(q, "taken", "published") == [] and q.get("taken").status == S.needs_human
    assert "lease lost; nothing published" in (tmp_path / "h1.err").read_text()

    # Cut off from the database while the container runs: no renewal succeeds within the lease,
    # so the runner stops its container and publishes nothing; the lapsed lease is a person's.
    submit(pg_url, sub, "cut", "sleep 60")
    px = Proxy(str(pg_cluster.sock))
    url = px.url(pg_url, str(pg_cluster.sock))
    p = start_worker(url, runner.path, "h1", "--once", "--lease", "3", env=host_env(tmp_path, "h1"))
    err = tmp_path / "h1.err"
    try:
        _wait(lambda: q.task_state("cut")["started"])
        px.cut()
        # Within the 3 s lease on the runner's own clock, then its next check; the bound is half
        # the job's 60 s, far from the failure (a container run to its end), not a tight timing.
        _wait(lambda: "lease lost; nothing published" in err.read_text(), 30)
        assert FakeBackend(tmp_path / "h1.boxes").find(job_id="cut") == []  # its container is gone
    finally:
        p.kill()
        p.wait(10)
        px.close()
    _wait(lambda: q.task_state("cut")["lease_expires_at"] <= q.clock(), 10)
    assert q.sweep() == [("cut", S.needs_human)]
    assert events(q, "cut", "published") == []


@pytest.mark.docker
def test_the_shell_engine_runs_in_docker_through_the_database_with_the_runners_spare_gateway(
    pg_url: str,
    q: PgQueue,
    sub: Root,
    tmp_path: Path,
    shell_image: ImageRef,
    gateway_image: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An allowlist task on a Docker runner: the runner keeps a spare gateway for the policies it
    takes, the job takes it (gateway_take), and nothing of the job or the spare is left."""
    import docker

    client = docker.from_env()
    net = client.networks.create(
        f"fila-test-egress-{tmp_path.name[-8:]}", internal=True, labels={"fila": "1"}
    )
    try:
        runner = make_root(tmp_path / "runner")
        egress = {"allow": [{"host": "allowed.test", "port": 443}], "egress_network": net.name}
        policy = {
            "network": "allowlist",
            "max_timeout_ms": 60_000,
            "default_timeout_ms": 30_000,
            "egress": egress,
        }
        for root in (sub, runner):
            (root.policies_dir / "allow.json").write_text(json.dumps(policy))
        res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", "dk", "--engine", "shell",
                   "--command", "echo docker >> greeting.txt", "-t", "greeting.txt",
                   "--policy", "allow")  # fmt: skip
        assert res.exit_code == 0, res.output
        monkeypatch.delenv("FILA_BACKEND", raising=False)
        res = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "d1", "--once",
                   "--engine", "shell", "--policy", "allow")  # fmt: skip
        assert res.exit_code == 0, res.output
        rec = q.get("dk")
        assert rec.status == S.needs_review and rec.backend == "docker" and rec.container_started
        assert "gateway_take" in rec.timings and "gateway_start" not in rec.timings, rec.timings
        assert b"+docker" in q.blob(q.task_blobs("dk")["DIFF.patch"])
        left = subprocess.run(["docker", "ps", "-aq", "--filter", "label=fila.job=dk"],
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
        left += subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fila.root={runner.path}"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        assert left == "" and not any(runner.spares_dir.iterdir())
    finally:
        net.reload()
        for cid in net.attrs.get("Containers") or {}:
            client.api.remove_container(cid, force=True)
        net.remove()


def test_status_lists_the_runners_and_says_a_task_for_an_engine_no_live_runner_has_waits(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path
) -> None:
    runner = make_root(tmp_path / "h1")
    p = start_worker(pg_url, runner.path, "h1", "--engine", "shell", "--policy", "default", "--poll", "0.2",
                     env=host_env(tmp_path, "h1"))  # fmt: skip
    try:
        # The allowed counterpart: a task for an engine the runner has is taken.
        submit(pg_url, sub, "sh", "echo w >> greeting.txt")
        # An engine this runner does not have (queued as a host with that engine's policy would),
        # many times over: status says how many wait, and why, in one line.
        q.enqueue("cx", Task(engine="codex", targets=["greeting.txt"], prompt="tidy up"))
        for i in range(150):
            q.enqueue(f"cx{i:03d}", Task(engine="codex", targets=["greeting.txt"], prompt="tidy up"))
        # A policy this runner does not take (--policy default): left for another runner.
        q.enqueue("other", Task(engine="shell", command="true", targets=["greeting.txt"], policy="other"))
        end = time.monotonic() + 20
        while q.get("sh").status != S.needs_review and time.monotonic() < end:
            time.sleep(0.1)
        assert q.get("sh").status == S.needs_review
        st = fila("status", "--queue", pg_url)
        assert st.exit_code == 0, st.output
        assert "runners:  1 live of 1 known" in st.output
        assert "h1  live  engines shell  policies default  slots 1" in st.output
        assert [line for line in st.output.splitlines() if line.startswith("waiting:")] == [
            "waiting:  151 tasks: no live runner has engine codex "
            "(cx, cx000, cx001, cx002, cx003 and 146 more)",
            "waiting:  1 task: no live runner with engine shell takes policy other (other)",
        ], st.output
        assert q.get("other").status == S.queued and q.get("cx").status == S.queued
        doc = json.loads(fila("status", "--queue", pg_url, "--json").output)
        assert [t["id"] for t in doc["unrunnable"]] == ["cx", *(f"cx{i:03d}" for i in range(150)), "other"]
        assert [(g["count"], g["why"]) for g in doc["waiting"]] == [
            (151, "no live runner has engine codex"),
            (1, "no live runner with engine shell takes policy other"),
        ]
        [h1] = doc["runners"]
        assert h1["live"] and h1["engines"] == ["shell"] and "shell" in h1["images"]
        assert h1["policies"] == ["default"]
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0, (tmp_path / "h1.err").read_text()
    finally:
        p.kill()
    st = fila("status", "--queue", pg_url)  # a stopped runner is known, not live
    assert "runners:  0 live of 1 known" in st.output and "h1  stopped" in st.output
    assert q.get("cx").status == S.queued


def test_a_hostile_or_oversized_manifest_fails_its_own_task_and_the_runner_goes_on(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.core.errors import InvalidInput
    from fila.queue.pg.blobs import Blob
    from fila.run.remote_inputs import unpack

    runner = make_root(tmp_path / "h1")
    default = json.loads((runner.policies_dir / "default.json").read_text())
    small = {**default, "max_work_files": 3, "max_work_bytes": 64}
    (runner.policies_dir / "small.json").write_text(json.dumps(small))
    ok, fifty, nul = Blob.of("file", b"hello\n"), Blob.of("file", b"x" * 50), Blob.of("file", b"evil\x00t")

    def entry(path: str, blob: Blob, kind: str = "file") -> dict[str, Any]:
        return {"path": path, "kind": kind, "size": len(blob.data), "sha256": blob.sha256, "mode": 0o644}

    def man(*entries: dict[str, Any]) -> bytes:
        return json.dumps({"version": 1, "targets": ["."], "entries": list(entries)}).encode()

    # Each distinct blob is fetched once, and a manifest over the limits fetches and writes nothing.
    fetched: list[str] = []

    class Source:
        def blob(self, sha256: str) -> bytes:
            fetched.append(sha256)
            return {b.sha256: b.data for b in (ok, fifty)}[sha256]

    two = man(entry("a", ok), entry("b", ok))
    assert unpack(Source(), two, tmp_path / "two", max_files=3, max_bytes=64) == ["a", "b"]
    assert fetched == [ok.sha256] and (tmp_path / "two" / "b").read_bytes() == b"hello\n"
    (tmp_path / "over").mkdir()
    with pytest.raises(InvalidInput, match="over the policy's max_work_files 3"):
        unpack(Source(), man(*(entry(f"f{i}", ok) for i in range(4))), tmp_path / "over", max_files=3,
               max_bytes=64)  # fmt: skip
    with pytest.raises(InvalidInput, match="100 bytes in all, over the policy's max_work_bytes 64"):
        unpack(Source(), man(entry("a", fifty), entry("b", fifty)), tmp_path / "over", max_files=3,
               max_bytes=64)  # fmt: skip
    assert fetched == [ok.sha256] and list((tmp_path / "over").iterdir()) == []

    # Through a runner: the allowed counterparts run, every hostile manifest fails its own task.
    submit(pg_url, sub, "good", "echo ok >> greeting.txt")
    surrogate = json.dumps({"version": 1, "targets": ["."], "entries": [entry("a\ud800", ok)]}).encode()
    cases: dict[str, tuple[str, bytes, list[Blob], str]] = {
        "fits": ("small", two, [ok], ""),
        "nul-link": ("default", man(entry("l", nul, "symlink")), [nul], "NUL byte"),
        "surrogate": ("default", surrogate, [ok], "cannot be encoded"),
        "control": ("default", man(entry("a\x1b[2Jb", ok)), [ok], "control character"),
        "bidi": ("default", man(entry("evil\u202etxt.sh", ok)), [ok], "bidi override"),
        "deep": ("default", b"[" * 200_000 + b"]" * 200_000, [], "nested too deeply"),
        "many": ("small", man(*(entry(f"f{i}", ok) for i in range(300))), [ok], "max_work_files 3"),
        "big": ("small", man(entry("a", fifty), entry("b", fifty)), [fifty], "max_work_bytes 64"),
    }
    for tid, (policy, manifest, files, _why) in cases.items():
        task = Task(engine="shell", command="echo ran >> a", targets=["."], policy=policy)
        q.enqueue(tid, task, inputs=Blob.of(INPUTS, manifest), files=files)
    for k, v in host_env(tmp_path, "h1").items():
        monkeypatch.setenv(k, v)
    res = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once")
    # --once: 2, as `run --once`, when tasks were invalid and none failed otherwise (good and fits
    # ran); the runner itself went on.
    assert res.exit_code == 2, res.output
    assert q.get("good").status == S.needs_review and q.get("fits").status == S.needs_review
    for tid, (_policy, _manifest, _files, why) in cases.items():
        if not why:
            continue
        rec = q.get(tid)
        assert rec.status == S.failed and rec.error is not None and not rec.container_started, tid
        assert rec.error.kind == "invalid" and why in rec.error.message, (tid, rec.error.message)
    assert not (runner.path / "remote").exists() or list((runner.path / "remote").iterdir()) == []


def test_a_lease_runs_out_on_the_runners_clock_while_its_renewal_hangs_on_a_silent_network(
    q: PgQueue, pg_url: str, pg_cluster: Any
) -> None:
    import threading

    from fila.queue.store import LeaseLost
    from fila.run.lease_hooks import LeaseHooks, Renewer
    from tests.support.pgproxy import Proxy

    ttl = 2.0
    q.enqueue("t", Task(engine="shell", command="true", targets=["a"]))
    lease = q.claim("h1", ["shell"], ttl)
    assert lease is not None
    px = Proxy(str(pg_cluster.sock))
    # No io_timeout_s: the renewal's call blocks for as long as the network is silent.
    beat = PgQueue(px.url(pg_url, str(pg_cluster.sock)), max_size=1, reconnect_s=1)
    hooks = LeaseHooks(q, lease, threading.Event(), ttl)
    renewer = Renewer(beat, hooks, ttl, None)
    renewer.start()
    try:
        time.sleep(ttl * 1.5)  # the allowed counterpart: renewed past its first lease, still held
        hooks.check()
        assert q.task_state("t")["lease_expires_at"] > q.clock()
        px.freeze()  # packets dropped, no reset: the next renewal never returns
        t0 = time.monotonic()
        with pytest.raises(LeaseLost):
            while True:
                hooks.check()
                assert time.monotonic() - t0 < 30, "the lease never ran out on the runner's side"
                time.sleep(0.05)
        assert renewer.is_alive()  # still blocked in renew(): the deadline did not wait for it
        assert time.monotonic() - t0 <= ttl + 5  # at most a lease after the last renewal, with room
    finally:
        renewer.stop.set()
        px.cut()  # the blocked renewal errs and its thread ends
        renewer.join(10)
        beat.close()
        px.close()


def test_a_long_running_runner_outlasts_a_database_outage_and_claims_again_after_it(
    pg_url: str, q: PgQueue, pg_cluster: Any, sub: Root, tmp_path: Path
) -> None:
    import threading

    from fila.run.remote import RemoteWorker
    from fila.sandbox.fake import FakeBackend
    from tests.support.pgproxy import Proxy

    px = Proxy(str(pg_cluster.sock))
    said: list[str] = []
    w = RemoteWorker(make_root(tmp_path / "h1"), px.url(pg_url, str(pg_cluster.sock)), host_id="h1",
                     engines=["shell"], backend=FakeBackend(tmp_path / "h1.boxes"), poll_s=0.2,
                     reconnect_s=1.0, progress=said.append)  # fmt: skip
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(w.run()), daemon=True)
    t.start()
    try:
        submit(pg_url, sub, "before", "echo 1 >> greeting.txt")  # the allowed counterpart
        _wait(lambda: q.get("before").status == S.needs_review, 60)
        px.cut()  # the database does not answer for longer than the runner's reconnect_s
        _wait(lambda: sum("did not answer" in m for m in said) >= 2, 60)
        assert t.is_alive() and not codes  # it waits; it did not exit
        px.heal()
        submit(pg_url, sub, "after", "echo 2 >> greeting.txt")
        _wait(lambda: q.get("after").status == S.needs_review, 60)
    finally:
        w.cancel.set()
        t.join(30)
        px.close()
    assert codes == [0] and [r.id for r in w.records] == ["before", "after"]


def test_a_long_running_runner_keeps_only_its_newest_records_and_specs_nothing_per_task(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from fila.run import slots
    from fila.run.remote import RemoteWorker
    from fila.sandbox import fake

    monkeypatch.setattr(slots, "KEPT", 2)
    monkeypatch.setattr(fake, "KEPT", 2)
    backend = fake.FakeBackend(tmp_path / "h1.boxes")
    w = RemoteWorker(make_root(tmp_path / "h1"), pg_url, host_id="h1", engines=["shell"], backend=backend,
                     poll_s=0.2)  # fmt: skip
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        for i in range(3):
            submit(pg_url, sub, f"k{i}", f"echo {i} >> greeting.txt")
        _wait(lambda: all(q.get(f"k{i}").status == S.needs_review for i in range(3)), 60)
    finally:
        w.cancel.set()
        t.join(30)
    assert [r.id for r in w.records] == ["k1", "k2"]  # all three ran; the newest two are kept
    assert [s.job_id for s in backend.specs] == ["k1", "k2"]
    # `--once` keeps every record: its exit code reads them.
    for i in range(3, 6):
        submit(pg_url, sub, f"k{i}", f"echo {i} >> greeting.txt")
    once = RemoteWorker(make_root(tmp_path / "h2"), pg_url, host_id="h2", engines=["shell"], once=True,
                        backend=fake.FakeBackend(tmp_path / "h2.boxes"), poll_s=0.2)  # fmt: skip
    assert once.run() == 0 and [r.id for r in once.records] == ["k3", "k4", "k5"]


def test_a_host_whose_engine_fails_before_the_container_hands_the_task_back_uncounted(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path
) -> None:
    """A sick host spends none of a task's tries (they are not one host's to spend), however often
    it claims it, and its record keeps one such hand-back, not one per claim; a fallback's or the
    check's missing image counts, the task's own engine's image removed after the start is the
    host's. Fake backend; about three seconds."""
    import errno

    import fila.workspace.jobdir as jobdir
    from fila.core.errors import ImageMissing, InfraError
    from fila.engines import get_engine
    from fila.run.remote import RemoteWorker
    from fila.sandbox.fake import FakeBackend
    from fila.sandbox.fake_job import Act

    runner = make_root(tmp_path / "h1")
    submit(pg_url, sub, "t", "echo t >> greeting.txt")

    def once(err: BaseException | None) -> RemoteWorker:
        script = {"t": Act(files={"greeting.txt": "t\n"}, error=err, error_at="create")} if err else None
        w = RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], once=True, poll_s=0.2,
                         backend=FakeBackend(tmp_path / "boxes", script=script))  # fmt: skip
        w.run()
        return w

    budget = q.task_state("t")["max_tries"]
    for _ in range(budget + 1):  # more claims than the task has tries: none spent
        w = once(InfraError("the engine did not answer (injected)"))
        assert w.exit_code() == 3 and isinstance(w.infra_error, InfraError), w.infra_error
        st = q.task_state("t")
        assert (st["state"], st["tries"]) == ("queued", 0), st
        clear_backoff(pg_url, "t")
    # The record (rewritten whole at each change) keeps the latest of the hand-backs in a row.
    assert [a.outcome for a in q.get("t").attempts] == ["handed back"], q.get("t").attempts
    # The host's disk failing while the run path checks the targets (an I/O error, once): the same.
    real = jobdir.resolve_targets
    calls: list[int] = []

    def eio_once(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jobdir, "resolve_targets", eio_once)
        w = once(None)
    assert calls and w.exit_code() == 3 and "Input/output error" in str(w.infra_error), w.infra_error
    st = q.task_state("t")
    assert (st["state"], st["tries"]) == ("queued", 0), st
    clear_backoff(pg_url, "t")
    # The task's engine's image removed after the runner started: the host's; the runner leaves
    # that engine out, and with none left it stops (exit 3) rather than idle.
    boxes = FakeBackend(tmp_path / "boxes")

    def rm_image(msg: str) -> None:
        if msg.startswith("t: claimed"):
            boxes.remove_image(get_engine("shell").image_tag())

    gone = RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], once=True, poll_s=0.2,
                        backend=boxes, progress=rm_image)  # fmt: skip
    with pytest.raises(InfraError, match="no engine left that it can run"):
        gone.run()
    st = q.task_state("t")
    assert (st["state"], st["tries"]) == ("queued", 0) and "has no image" in str(q.get("t").error), st
    clear_backoff(pg_url, "t")
    # A missing image the run path meets counts (bounded): the task's engine's was checked, so it
    # is a fallback's or the check's, which the runner would otherwise claim and hand back forever.
    once(ImageMissing("image fila/shell:latest is not present in fake (injected)"))
    assert q.task_state("t")["tries"] == 1
    clear_backoff(pg_url, "t")
    # A healthy host then runs it once.
    w = once(None)
    assert [(r.id, r.status) for r in w.records] == [("t", S.needs_review)], w.records
    # The task's engine's image removed when the task pins that tag: the host's image too.
    own = get_engine("shell").image_tag()
    res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", "pin", "--engine", "shell",
               "--image", own, "--command", "true", "-t", "greeting.txt")  # fmt: skip
    assert res.exit_code == 0, res.output
    boxes = FakeBackend(tmp_path / "pinned")

    def rm_pinned(msg: str) -> None:
        if msg.startswith("pin: claimed"):
            boxes.remove_image(own)

    pinned = RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], once=True, poll_s=0.2,
                          backend=boxes, progress=rm_pinned)  # fmt: skip
    with pytest.raises(InfraError, match="no engine left"):
        pinned.run()
    assert (q.task_state("pin")["state"], q.task_state("pin")["tries"]) == ("queued", 0)


def test_a_runner_without_policy_claims_only_the_policies_it_can_run(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path
) -> None:
    """Without --policy a runner claims the policies its root has that load and whose runtime its
    engine has: a task of another stays queued, its tries unspent, for a runner that can run it,
    never failed here nor run under fila's shipped policy of its name; a policy that stops loading
    after the start, or becomes a link, is the host's too (its task back uncounted, the policy
    claimed no more, the runners table saying so). A task that asks more than the runner's policy
    allows is the task's: it fails `invalid`, and the runner keeps the policy. A runner whose last
    policy is left out stops (exit 3). Fake backend; ~3 s."""
    import psycopg

    from fila.core.errors import InfraError
    from fila.run.remote import RemoteWorker
    from fila.sandbox.fake import FakeBackend

    runner = make_root(tmp_path / "h1")
    default = json.loads((runner.policies_dir / "default.json").read_text())
    capped = {**default, "max_timeout_ms": 60000, "default_timeout_ms": 60000}
    (runner.policies_dir / "default.json").write_text(json.dumps(capped))  # the submitter's allows more
    (runner.policies_dir / "gv.json").write_text(json.dumps({**default, "runtime": "runsc"}))
    (tmp_path / "strict.json").write_text(json.dumps({**default, "max_work_files": 0}))
    (runner.policies_dir / "lnk.json").symlink_to(tmp_path / "strict.json")
    (runner.policies_dir / "brk.json").write_text(json.dumps(default))  # loads at start, not later
    # A shipped policy's name, overridden here, made a link once its task is claimed: never run
    # under fila's shipped file of that name.
    (runner.policies_dir / "anthropic.json").write_text(json.dumps(default))
    named = ("team", "gv", "lnk", "brk", "anthropic")
    for name in named:  # the submitter has each, as a plain file
        (sub.policies_dir / f"{name}.json").write_text(json.dumps(default))
    submit(pg_url, sub, "ok", "echo ok >> greeting.txt")
    res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", "wide", "--engine", "shell",
               "--timeout", "120000", "--command", "true", "-t", "greeting.txt")  # fmt: skip
    assert res.exit_code == 0, res.output
    for name in named:
        res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", name, "--engine", "shell",
                   "--policy", name, "--command", "echo x >> greeting.txt", "-t", "greeting.txt")  # fmt: skip
        assert res.exit_code == 0, res.output
    said: list[str] = []

    def progress(msg: str) -> None:  # brk's file is broken once its task is claimed (an edit)
        said.append(msg)
        if msg.startswith("brk: claimed"):
            (runner.policies_dir / "brk.json").write_text("{ half-written")
        if msg.startswith("anthropic: claimed"):
            (tmp_path / "elsewhere.json").write_text(json.dumps(default))
            (runner.policies_dir / "anthropic.json").unlink()
            (runner.policies_dir / "anthropic.json").symlink_to(tmp_path / "elsewhere.json")

    w = RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], once=True, poll_s=0.2,
                     backend=FakeBackend(tmp_path / "boxes"), progress=progress)  # fmt: skip
    assert w.run() == 2  # `wide` is invalid, as `fila run --once` says of an invalid task
    got = {r.id: (r.status, r.error.kind if r.error else None) for r in w.records}
    assert got == {"ok": (S.needs_review, None), "wide": (S.failed, "invalid")}, w.records
    assert "above the cap of policy 'default'" in str(q.get("wide").error), q.get("wide").error
    assert "default" in (w.policies or []), w.policies
    for name in ("brk", "anthropic"):
        assert name not in (w.policies or []), w.policies
        assert any(f"policy {name} left out from now on" in m for m in said), said
    for name in named:
        st = q.task_state(name)
        assert (st["state"], st["tries"]) == ("queued", 0), (name, st)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute("SELECT policies FROM fila_runners WHERE id = 'h1'").fetchone()
    assert row is not None and "default" in row[0] and not {"brk", "anthropic"} & set(row[0]), row
    left = " ".join(m for m in said if "left out" in m)
    assert "policy gv left out" in left and "runsc" in left, said
    assert "policy lnk left out" in left, said
    # A runner whose only policy is left out stops rather than idle, the task still queued.
    (runner.policies_dir / "brk.json").write_text(json.dumps(default))
    last = RemoteWorker(runner, pg_url, host_id="h2", engines=["shell"], policies=["brk"], once=True,
                        poll_s=0.2, backend=FakeBackend(tmp_path / "boxes"), progress=progress)  # fmt: skip
    with pytest.raises(InfraError, match="no policy left that it can run"):
        last.run()
    st = q.task_state("brk")
    assert (st["state"], st["tries"]) == ("queued", 0), st


def _two_vendors(base: dict[str, Any], images: list[str]) -> dict[str, Any]:
    """An allowlist policy naming two vendors' routes, each key from its own variable."""
    routes = {"anthropic": {"credential": "T_ANTHROPIC_KEY"}, "openai": {"credential": "T_OPENAI_KEY"}}
    return {**base, "egress": {**base["egress"], "routes": routes}, "images": images}


def test_a_policy_is_claimed_only_when_the_host_can_run_it_whole_and_a_tasks_own_asks_fail_the_task(
    pg_url: str, q: PgQueue, sub: Root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task chooses its engines, so it must not choose what the host lacks: a runner claims a
    policy only when it can run it whole (every route's credential set here), checked at its start;
    then what a task asks beyond the runner's policy (a fallback whose image the policy does not
    allow, a fallback whose route it lacks) fails that task `invalid`, as on the file queue, and the
    runner keeps the policy and goes on. The runner's own policy file removed after the start is the
    host's lack (never fila's shipped file of that name). Fake backend; ~3 s."""
    from fila.core.errors import InfraError
    from fila.run.remote import RemoteWorker
    from fila.sandbox.fake import FakeBackend

    shipped = json.loads((sub.policies_dir / "anthropic.json").read_text())
    (sub.policies_dir / "team.json").write_text(json.dumps(_two_vendors(shipped, ["fila/*"])))
    (sub.policies_dir / "anthropic.json").write_text(json.dumps(_two_vendors(shipped, ["fila/*"])))
    keys = {"T_ANTHROPIC_KEY": "k", "T_OPENAI_KEY": "k", "ANTHROPIC_API_KEY": "k"}
    for tid, pol in (("fb", "team"), ("noroute", "anthropic"), ("gone", "default")):
        eng = ["--engine", "shell", "--command", "true"] if pol == "default" else ["--engine", "claude",
               "--prompt", "hi", "--fallback", "codex"]  # fmt: skip
        res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", tid, "--policy", pol,
                   *eng, "-t", "greeting.txt", env=keys)  # fmt: skip
        assert res.exit_code == 0, res.output
    runner = make_root(tmp_path / "h1")  # its anthropic policy is fila's shipped one: one route
    (runner.policies_dir / "team.json").write_text(json.dumps(_two_vendors(shipped, ["fila/claude:*"])))
    for var, val in keys.items():
        monkeypatch.setenv(var, val)
    monkeypatch.delenv("T_OPENAI_KEY")
    said: list[str] = []

    def worker(**kw: Any) -> RemoteWorker:
        return RemoteWorker(runner, pg_url, host_id="h1", once=True, poll_s=0.2,
                            backend=FakeBackend(tmp_path / "boxes"), progress=said.append, **kw)  # fmt: skip

    # One route's key missing here: named, the start is refused; unnamed, the policy is left out.
    with pytest.raises(InfraError, match="T_OPENAI_KEY"):
        worker(engines=["claude"], policies=["team"]).run()
    w = worker(engines=["claude"])
    assert w.run() == 2 and "team" not in (w.policies or [])
    assert any("policy team left out" in m and "T_OPENAI_KEY" in m for m in said), said
    assert q.task_state("fb")["state"] == "queued"
    # `noroute` ran on that runner: its fallback's route is not in the runner's anthropic policy.
    assert "no egress.routes.openai" in str(q.get("noroute").error) and q.get("noroute").status == S.failed
    # With both keys the policy is claimed; the task's fallback image, which the runner's policy
    # does not allow, fails the task, and the runner keeps the policy.
    monkeypatch.setenv("T_OPENAI_KEY", "k")
    w = worker(engines=["claude"], policies=["team"])
    assert w.run() == 2 and w.policies == ["team"], said
    fb = q.get("fb")
    assert fb.status == S.failed and fb.error is not None and fb.error.kind == "invalid", fb.error
    assert "fallback engine 'codex' runs image" in fb.error.message
    # The runner's own file of a policy removed after its start: back uncounted, the policy left out.
    own = runner.policies_dir / "default.json"
    own.write_text(json.dumps({**json.loads(own.read_text()), "description": "this runner's own"}))

    def rm_own(msg: str) -> None:
        said.append(msg)
        if msg.startswith("gone: claimed"):
            own.unlink()

    w = RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], policies=["default"], once=True,
                     poll_s=0.2, backend=FakeBackend(tmp_path / "boxes"), progress=rm_own)  # fmt: skip
    with pytest.raises(InfraError, match="no policy left"):
        w.run()
    st = q.task_state("gone")
    assert (st["state"], st["tries"]) == ("queued", 0) and "gone since its start" in str(q.get("gone").error)


def test_a_policy_whose_gateway_or_credential_the_host_cannot_use_is_not_the_hosts_to_claim(
    tmp_path: Path,
) -> None:
    """policy_lacks reads a route's credential as the gateway reads it, and wants the gateway's
    image: a credential file that is empty or not UTF-8, or no gateway image, leaves the policy
    out (each after the allowed counterpart passes), never a task failed here for it. No
    database; fake backend."""
    import os

    from fila.run.remote_host import policy_lacks
    from fila.sandbox.fake import FakeBackend
    from fila.sandbox.images import GATEWAY_IMAGE

    root = make_root(tmp_path / "h1")
    shipped = json.loads((root.policies_dir / "anthropic.json").read_text())
    key = tmp_path / "key"
    route = {"anthropic": {"credential_file": str(key)}}
    (root.policies_dir / "team.json").write_text(
        json.dumps({**shipped, "egress": {**shipped["egress"], "routes": route}})
    )
    backend = FakeBackend(tmp_path / "boxes")
    key.write_bytes(b"sk-test\n")
    os.chmod(key, 0o600)
    assert policy_lacks(root, "team", backend) is None
    for content, why in ((b"", "the credential is empty"), (b"\xff\xfe\x80key\n", "is not UTF-8 text")):
        key.write_bytes(content)
        assert why in (policy_lacks(root, "team", backend) or ""), content
    key.write_bytes(b"sk-test\n")
    backend.remove_image(GATEWAY_IMAGE)
    assert f"has no image {GATEWAY_IMAGE}" in (policy_lacks(root, "team", backend) or "")
    assert policy_lacks(root, "default", backend) is None  # network none needs no gateway
