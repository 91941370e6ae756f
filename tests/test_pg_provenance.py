"""Signed provenance on the PostgreSQL queue (docs/provenance.md): a runner host signs the run
statement with its own key and publishes it as a blob with the record; the trusted keys are the
database's (migration 0006); a reviewer's apply or reject signs the decision with theirs. Real
PostgreSQL (tests/support/pg.py), the fake backend for the runner. Each refused case follows its
allowed counterpart."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import psycopg
import pytest
from securesystemslib.dsse import Envelope
from securesystemslib.signer import SSlibKey

from fila.provenance import keys, store
from fila.queue.pg.blobs import Blob
from fila.queue.pg.store import PgQueue
from tests.support.pg_runner import fila, host_env
from tests.support.project import GREETING, make_project, make_root


def verify(url: str, tid: str) -> tuple[int, dict]:
    res = fila("verify", tid, "--queue", url, "--json")
    return res.exit_code, json.loads(res.stdout)


def test_a_runners_key_signs_and_verifies_once_the_queue_trusts_it(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = make_project(tmp_path / "submitter")
    for tid, command in [("t1", "echo bye >> greeting.txt"), ("t2", "echo bye >> greeting.txt"),
                         ("t3", "echo three >> greeting.txt")]:  # fmt: skip
        res = fila("submit", "--queue", pg_url, "--root", str(sub.path), "--id", tid, "--engine", "shell",
                   "--command", command, "-t", "greeting.txt")  # fmt: skip
        assert res.exit_code == 0, res.output
    runner = make_root(tmp_path / "runner")
    assert fila("keys", "init", "--root", str(runner.path)).exit_code == 0  # its own root only
    alice = make_project(tmp_path / "alice")
    res = fila("keys", "init", "--root", str(alice.path), "--queue", pg_url, "--name", "alice")
    assert res.exit_code == 0 and "trusted in the queue database" in res.output, res.output
    for k, v in host_env(tmp_path, "h1").items():
        monkeypatch.setenv(k, v)
    res = fila("worker", "--queue", pg_url, "--root", str(runner.path), "--host-id", "h1", "--once")
    assert res.exit_code == 0, res.output
    runner_pub = keys.keys_dir(runner) / keys.PUBLIC
    runner_key = keys.read_public(runner_pub)
    q = PgQueue(pg_url)
    try:
        assert store.blob_name("run") in q.task_blobs("t1")
        # The runner's key is not in the queue's trusted set: refused by verify and by apply.
        code, v = verify(pg_url, "t1")
        assert code == 4 and "which is not trusted in the queue database" in v["problems"][0], v
        res = fila("apply", "t1", "--queue", pg_url, "--root", str(alice.path), "--yes", "--by", "alice")
        assert res.exit_code == 4 and "not trusted" in res.output, res.output
        assert (alice.path / "greeting.txt").read_text() == GREETING

        res = fila("keys", "trust", str(runner_pub), "--queue", pg_url, "--name", "runner h1")
        assert res.exit_code == 0 and res.output.startswith("trusted"), res.output
        listed = json.loads(fila("keys", "ls", "--queue", pg_url, "--json").stdout)
        assert {k["name"] for k in listed} == {"alice", "runner h1"}
        code, v = verify(pg_url, "t1")
        assert code == 0 and v["signed_by"] == {"run": runner_key.keyid}, v
        assert v["run"]["runner"] == {"host": "h1", "queue": "postgresql"}
        shown = fila("review", "t1", "--queue", pg_url, "--root", str(alice.path), "--no-pager")
        assert "provenance verified (run)" in shown.output, shown.output

        beside = tmp_path / "beside"
        res = fila("apply", "t1", "--queue", pg_url, "--root", str(alice.path), "--yes", "--by", "alice",
                   "--attestations", str(beside))  # fmt: skip
        assert res.exit_code == 0 and "decision statement signed" in res.output, res.output
        for kind in ("run", "decision"):  # written beside the landing: the bytes the database keeps
            kept = q.blob(q.task_blobs("t1")[store.blob_name(kind)])
            assert (beside / f"t1.{kind}.intoto.json").read_bytes() == kept
        code, v = verify(pg_url, "t1")
        alice_key = keys.read_public(keys.keys_dir(alice) / keys.PUBLIC)
        assert code == 0 and v["signed_by"] == {"run": runner_key.keyid, "decision": alice_key.keyid}, v
        assert v["decision"]["by"] == "alice" and v["decision"]["action"] == "applied"

        # The envelopes in the database verify with securesystemslib, on the keys' files alone.
        for kind, pub in (("run", runner_pub), ("decision", keys.keys_dir(alice) / keys.PUBLIC)):
            doc = json.loads(q.blob(q.task_blobs("t1")[store.blob_name(kind)]))
            key_doc = json.loads(pub.read_text())
            key = SSlibKey.from_dict(key_doc.pop("keyid"), key_doc)
            assert list(Envelope.from_dict(doc).verify([key], 1)) == [key.keyid]

        # Exported, the same files verify with no queue at hand, trusting the two public keys only.
        out = tmp_path / "export"
        res = fila("verify", "t1", "--queue", pg_url, "--export", str(out))
        assert res.exit_code == 0, res.output
        names = sorted(p.name for p in out.iterdir())
        assert names == sorted(["DIFF.patch", "t1.run.json", "t1.decision.json",
                                f"{runner_key.keyid}.pub.json", f"{alice_key.keyid}.pub.json"])  # fmt: skip
        res = fila("verify", "--patch", str(out / "DIFF.patch"), "--attestation", str(out / "t1.run.json"),
                   "--attestation", str(out / "t1.decision.json"),
                   "--key", str(out / f"{runner_key.keyid}.pub.json"),
                   "--key", str(out / f"{alice_key.keyid}.pub.json"))  # fmt: skip
        assert res.exit_code == 0 and "verified (run and decision)" in res.output, res.output

        # t2 made the same DIFF.patch: its own statement verifies; t1's replayed for it does not.
        assert verify(pg_url, "t2")[0] == 0
        t1_run = q.blob(q.task_blobs("t1")[store.blob_name("run")])
        q.attach("t2", Blob.of(store.blob_name("run"), t1_run), event="test", data={})
        code, v = verify(pg_url, "t2")
        assert code == 4 and any("task t1's, not task t2's" in p for p in v["problems"]), v
        res = fila("apply", "t2", "--queue", pg_url, "--root", str(alice.path), "--yes", "--by", "alice")
        assert res.exit_code == 4 and "replayed" in res.output, res.output

        # t3's record changed in the database after the runner signed it: refused, naming the field.
        assert verify(pg_url, "t3")[0] == 0
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE fila_records SET record = jsonb_set(record, '{policy,sha256}', to_jsonb(%s::text)) "
                "WHERE id = 't3'",
                ("0" * 64,),
            )
        code, v = verify(pg_url, "t3")
        assert code == 4 and any("policy.sha256: signed" in p for p in v["problems"]), v
        res = fila("reject", "t3", "--queue", pg_url, "--root", str(alice.path), "--by", "alice")
        assert res.exit_code == 0, res.output  # a tampered task can still be rejected
        payload = json.loads(
            base64.b64decode(json.loads(q.blob(q.task_blobs("t3")["provenance.decision.json"]))["payload"])
        )
        assert payload["predicate"]["action"] == "rejected"
    finally:
        q.close()
