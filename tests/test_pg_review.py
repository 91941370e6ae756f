"""Review from anywhere (docs/scale-out.md): `fila apply`, `reject`, `retry` and `logs` with
`--queue URL`, from reviewers' own queue roots that are neither the submitter's nor the runner's.
The patch lands with apply's checks (review/apply.py), the decision is recorded once in the
database for everyone. Real PostgreSQL (tests/support/pg.py), the fake backend for the runner.
Each refused case follows its allowed counterpart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from fila.core.models import Status
from fila.queue.pg.store import PgQueue
from tests.support.pg import tamper_blob
from tests.support.pg_runner import CLI, events, fila, host_env
from tests.support.project import GREETING, make_project, make_root

S = Status


def test_a_queued_task_is_applied_from_another_root_once_for_everyone(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = make_project(tmp_path / "submitter")
    for tid, command in [("t1", "echo bye >> greeting.txt"), ("t2", "echo other >> greeting.txt"),
                         ("t3", "echo x >> greeting.txt; exit 3"),
                         ("t4", "echo four >> greeting.txt")]:  # fmt: skip
        res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", tid, "--engine", "shell",
                   "--command", command, "-t", "greeting.txt")  # fmt: skip
        assert res.exit_code == 0, res.output
    runner = make_root(tmp_path / "runner")
    for k, v in host_env(tmp_path, "h1").items():
        monkeypatch.setenv(k, v)
    res = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once")
    assert res.exit_code == 1 and "t3  failed" in res.output, res.output  # --once: 1 when a task failed
    alice, bob = make_project(tmp_path / "alice"), make_project(tmp_path / "bob")
    q = PgQueue(pg_url)
    try:
        assert [q.get(t).status for t in ("t1", "t2", "t3")] == [S.needs_review, S.needs_review, S.failed]
        assert q.get("t4").status == S.needs_review

        # Alice applies t1 in her checkout: it lands there only, and the database records it.
        res = fila("apply", "t1", "--queue", pg_url, "--root", str(alice.path), "--yes", "--by", "alice")
        assert res.exit_code == 0, res.output
        assert res.output.startswith(f"applied t1 to {alice.path}: 1 written")
        assert (alice.path / "greeting.txt").read_text() == GREETING + "bye\n"
        assert (sub.path / "greeting.txt").read_text() == GREETING  # the submitter's untouched
        assert not alice.job_dir("t1").exists() and not alice.meta("t1").exists()  # the copy is gone
        # A second reader (another process's connection, no root) sees the decision.
        shown = fila("show", "t1", "--queue", pg_url)
        assert "decision:  applied by alice" in shown.output and "status:    applied" in shown.output
        assert [e["by"] for e in events(q, "t1", "apply started")] == ["alice"]

        # Bob's second decision on t1 is refused naming who decided; his checkout is untouched.
        for cmd in (["apply", "--yes"], ["reject"]):
            res = fila(*cmd, "t1", "--queue", pg_url, "--root", str(bob.path), "--by", "bob")
            assert res.exit_code != 0 and "already applied by alice" in res.output, res.output
        assert (bob.path / "greeting.txt").read_text() == GREETING and q.get("t1").decision.by == "alice"

        # Carol's policy allows fewer bytes than t2's inputs: refused before anything is laid out.
        carol = make_project(tmp_path / "carol")
        pol = json.loads((carol.policies_dir / "default.json").read_text())
        (carol.policies_dir / "default.json").write_text(json.dumps({**pol, "max_work_bytes": 1}))
        res = fila("apply", "t2", "--queue", pg_url, "--root", str(carol.path), "--yes", "--by", "carol")
        assert res.exit_code != 0 and "over the policy's max_work_bytes 1" in res.output, res.output
        assert not carol.job_dir("t2").exists() and not carol.meta("t2").exists()
        assert q.get("t2").status == S.needs_review

        # Bob's checkout moved since t2 copied its files: refused, as on the file queue.
        (bob.path / "greeting.txt").write_text("top\n" + GREETING)
        res = fila("apply", "t2", "--queue", pg_url, "--root", str(bob.path), "--yes", "--by", "bob")
        assert res.exit_code != 0 and "moved base" in res.output and q.get("t2").status == S.needs_review
        assert not bob.job_dir("t2").exists()
        # A DIFF.patch blob altered in the database is refused before anything is laid out.
        sha = q.task_blobs("t2")["DIFF.patch"]
        tamper_blob(pg_url, sha, b"+other", b"+OTHER")
        res = fila(
            "apply", "t2", "--queue", pg_url, "--root", str(bob.path), "--yes", "--3way", "--by", "bob"
        )
        assert res.exit_code != 0 and sha in res.output, res.output
        assert (bob.path / "greeting.txt").read_text() == "top\n" + GREETING
        assert q.get("t2").status == S.needs_review and not bob.job_dir("t2").exists()

        # Reject and retry are recorded in the database too; logs are read from it.
        res = fila("reject", "t2", "--queue", pg_url, "--by", "bob", "-m", "tampered")
        assert res.exit_code == 0 and res.output.strip() == "rejected t2 by bob: tampered"
        res = fila("retry", "t3", "--queue", pg_url, "--by", "carol")
        assert res.exit_code == 0 and q.get("t3").status == S.queued, res.output
        log = fila("logs", "t3", "--queue", pg_url)
        assert log.exit_code == 0 and log.stdout_bytes == q.blob(q.task_blobs("t3")["log"])
        ev = fila("logs", "t1", "--queue", pg_url, "--events")
        assert ev.exit_code == 0 and '"event": "decided"' in ev.output

        # A review names the policy that judged the patch when this root cannot load the task's:
        # bob's root has `default`, erin's is unreadable.
        erin = make_project(tmp_path / "erin")
        (erin.policies_dir / "default.json").write_text("{")
        res = fila("review", "t4", "--queue", pg_url, "--root", str(bob.path), "--no-pager")
        assert res.exit_code == 0 and "cannot be loaded" not in res.output, res.output
        res = fila("review", "t4", "--queue", pg_url, "--root", str(erin.path), "--no-pager")
        assert res.exit_code == 0, res.output
        assert "policy 'default' cannot be loaded from this root" in res.output
        assert "judged by fila's built-in defaults" in res.output

        # Dave's apply of t4 lands and dies before its decision; bob rejects t4 from another host
        # meanwhile; dave's rerun is refused and takes the landing back.
        dave = make_project(tmp_path / "dave")
        cut = subprocess.run([*CLI, "apply", "t4", "--queue", pg_url, "--root", str(dave.path), "--yes",
                              "--by", "dave"], env={**os.environ, "FILA_CRASH_AT": "apply_before_record"},
                             capture_output=True, text=True)  # fmt: skip
        assert cut.returncode == -signal.SIGKILL, cut.stderr
        assert (dave.path / "greeting.txt").read_text() == GREETING + "four\n"
        res = fila("reject", "t4", "--queue", pg_url, "--by", "bob", "-m", "no")
        assert res.exit_code == 0, res.output
        res = fila("apply", "t4", "--queue", pg_url, "--root", str(dave.path), "--yes", "--by", "dave")
        assert res.exit_code == 4, res.output
        assert "rolled back 1 file: greeting.txt; task t4 was already rejected by bob" in res.output
        assert (dave.path / "greeting.txt").read_text() == GREETING
        assert not dave.job_dir("t4").exists() and not dave.meta("t4").exists()
        assert q.get("t4").status == S.rejected
    finally:
        q.close()
