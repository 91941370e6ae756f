"""A runner of the PostgreSQL queue publishes no path of its own host (docs/scale-out.md, "Running
it"; run/remote_publish.Redact): its root and the job root (`<root>/remote/<id>.<token>`) become
`<runner>` and `<job>`, the task's log `fila logs ID --queue URL`, in every string of the record,
a hand back's and a refusal's message and the events blob; DIFF.patch is published as it is.
Real PostgreSQL, the fake backend."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fila.core.errors import EXIT_DOCKER
from fila.core.layout import Root
from fila.core.models import Record, Status
from fila.queue.pg.store import PgQueue
from fila.run.remote import RemoteWorker
from fila.run.remote_publish import Redact, refuse
from tests.support.paths_backend import PathsBackend
from tests.support.pg_runner import fila
from tests.support.project import make_project, make_root


def submit(url: str, sub: Root, tid: str, command: str) -> None:
    res = fila("submit", "--queue", url, "--root", str(sub.path), "--id", tid, "--engine", "shell",
               "--command", command, "-t", "greeting.txt")  # fmt: skip
    assert res.exit_code == 0, res.output


def local(text: str, runner: Path) -> list[str]:
    """What of the runner's paths `text` still names."""
    found = [p for p in {str(runner), str(runner.resolve())} if p in text]
    return found + (["/remote/"] if "/remote/" in text else [])


def test_a_runner_publishes_its_records_hand_backs_and_events_without_its_local_paths(
    pg_url: str, q: PgQueue, tmp_path: Path
) -> None:
    sub = make_project(tmp_path / "submitter")
    submit(pg_url, sub, "ok", "echo bye >> greeting.txt")  # its warning names the log, job and root
    submit(pg_url, sub, "gone", "true")  # its box goes while it runs: needs_human, a diagnosis
    submit(pg_url, sub, "back", "true")  # no box is made: handed back, then the `--once` runner stops
    runner = make_root(tmp_path / "runner")
    w = RemoteWorker(runner, pg_url, host_id="h1", engines=["shell"], once=True, poll_s=0.2,
                     backend=PathsBackend(tmp_path / "boxes", runner.path))  # fmt: skip
    assert w.run() == EXIT_DOCKER

    ok = q.get("ok")  # the warning's three paths, each in its place
    assert ok.status == Status.needs_review
    said = "output pump cut at `fila logs ok --queue URL`; job in <job>/sandbox/jobs/ok/; gateway in <runner>"
    assert f"{said}/fila" in ok.warnings
    blobs = q.task_blobs("ok")
    patch = q.blob(blobs["DIFF.patch"])  # published as the job wrote it, its sha256 the record's
    assert b"+bye" in patch and hashlib.sha256(patch).hexdigest() == ok.patch_sha256 == blobs["DIFF.patch"]
    assert fila("diff", "ok", "--queue", pg_url).stdout_bytes == patch

    gone = q.get("gone")
    assert gone.status == Status.needs_human and gone.diagnosis is not None and gone.error is not None
    assert "the box went away (task gone, `fila logs gone --queue URL`)" in gone.diagnosis
    assert gone.error.message == "the box went away (task gone, `fila logs gone --queue URL`)"
    events = q.blob(q.task_blobs("gone")["events.jsonl"]).decode()
    assert "`fila logs gone --queue URL`" in events
    assert all(json.loads(line) for line in events.splitlines())  # still one JSON document a line

    back = q.get("back")  # the hand back's message, str(InfraError) with its path=
    assert back.status == Status.queued and back.error is not None
    assert back.error.message == "no box could be made (task back, `fila logs back --queue URL`)"

    for tid in ("ok", "gone", "back"):
        rec: Record = q.get(tid)
        assert local(rec.model_dump_json(), runner.path) == [], tid
        assert local(json.dumps(q.events(tid), default=str), runner.path) == [], tid
        if "events.jsonl" in q.task_blobs(tid):
            assert local(q.blob(q.task_blobs(tid)["events.jsonl"]).decode(), runner.path) == [], tid


def test_the_redaction_matches_whole_paths_realpaths_and_json_escapes_and_a_refusal_uses_it(
    pg_url: str, q: PgQueue, tmp_path: Path
) -> None:
    (tmp_path / "réal").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "réal")
    runner = tmp_path / "link" / 'r"1'
    job = runner / "remote" / "g.1"
    redact = Redact(Root(job), "g")
    real = tmp_path / "réal" / 'r"1' / "remote" / "g.1"
    assert redact.text(f"see {job}/fila/logs/g.log.") == "see `fila logs g --queue URL`."
    assert redact.text(f"{job}/ and {real}/work") == "<job>/ and <job>/work"
    assert redact.text(f"{runner}/remote/g.10 {runner}") == "<runner>/remote/g.10 <runner>"
    assert redact.text("/elsewhere/remote/g.1") == "/elsewhere/remote/g.1"  # not this runner's
    # A job root not under a runner's remote/: nothing above it is taken for the runner's root.
    assert Redact(Root(runner / "g.1"), "g").text(f"{runner}/g.1 {runner}") == f"<job> {runner}"
    line = json.dumps({"event": "status", "error": {"message": f"see {real}/work"}}) + "\n"
    assert "\\u00e9" in line and '\\"' in line  # the path as JSON escapes it
    kept = json.dumps({"event": "claimed"}) + "\n"
    out = redact.jsonl((kept + line).encode())
    assert out.startswith(kept.encode())  # a line that names none is kept byte for byte
    assert json.loads(out.splitlines()[1])["error"]["message"] == "see <job>/work"

    sub = make_project(tmp_path / "submitter")
    submit(pg_url, sub, "g", "true")
    lease = q.claim("h1", ["shell"], 30)
    assert lease is not None and lease.task_id == "g"
    rec = refuse(q, lease, Root(job), "fake", f"target a.txt escapes {job}/work")
    assert rec is not None and rec.error is not None
    assert rec.error.message == "target a.txt escapes <job>/work"
