"""Signed provenance on the file queue (docs/provenance.md): the run statement written when a task
reaches review, the decision statement chained to it, `fila verify` and `fila apply`'s refusal.
Each tampering case is shown beside its untampered counterpart; the envelopes are checked with
verifiers that are not fila's (securesystemslib, the in-toto attestation library, and an ed25519
check of DSSE's pre-authentication encoding written here). The fake backend runs the tasks (no
container is the point here)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fila.core.layout import Root
from fila.provenance import attest, keys, store
from fila.queue.store import get_record
from tests.support.cli import fila
from tests.support.project import GREETING, make_project, record

FAKE = {"FILA_BACKEND": "fake"}


@pytest.fixture
def root(tmp_path: Path) -> Root:
    r = make_project(tmp_path / "root", {"other.txt": "other\n"})
    res = fila(r, "keys", "init", "--json")
    assert res.exit_code == 0, res.output
    return r


def run_task(r: Root, command: str = "echo world > greeting.txt", target: str = "greeting.txt") -> str:
    env = {**FAKE, "FILA_FAKE_DIR": str(r.path.parent / "boxes")}
    res = fila(r, "submit", "--engine", "shell", "--command", command, "--target", target)
    assert res.exit_code == 0, res.output
    tid = res.stdout.strip()
    res = fila(r, "run", "--once", env=env)
    assert res.exit_code == 0 and record(r, tid)["status"] == "needs_review", res.output
    return tid


def verify(r: Root, tid: str) -> tuple[int, dict]:
    res = fila(r, "verify", tid, "--json")
    return res.exit_code, json.loads(res.stdout)


def apply(r: Root, tid: str):
    return fila(r, "apply", tid, "--yes", "--by", "alice")


def payload(data: bytes) -> dict:
    return json.loads(base64.b64decode(json.loads(data)["payload"]))


def test_a_task_in_review_is_signed_verified_applied_and_its_decision_chained(root: Root) -> None:
    key = keys.read_public(keys.keys_dir(root) / keys.PUBLIC)
    assert (keys.keys_dir(root) / keys.PRIVATE).stat().st_mode & 0o777 == 0o600
    tid = run_task(root)
    code, v = verify(root, tid)
    assert code == 0 and v["state"] == "verified" and v["signed_by"] == {"run": key.keyid}, v
    stmt = payload(store.path(root, tid, "run").read_bytes())
    rec = record(root, tid)
    assert stmt["subject"] == [{"name": "DIFF.patch", "digest": {"sha256": rec["patch_sha256"]}}]
    facts = stmt["predicate"]["facts"]
    assert facts["task"]["id"] == tid and facts["policy"]["sha256"] == rec["policy"]["sha256"]
    assert facts["attempts"][0]["image"]["id"] == rec["image"]["id"]
    assert stmt["predicate"]["limits"]["network"] == "none"
    shown = fila(root, "review", tid, "--no-pager")
    assert "provenance verified (run)" in shown.output, shown.output

    res = apply(root, tid)
    assert res.exit_code == 0 and "decision statement signed" in res.output, res.output
    assert (root.path / "greeting.txt").read_text() == "world\n"
    code, v = verify(root, tid)
    assert code == 0 and v["decision"]["action"] == "applied" and v["decision"]["by"] == "alice", v
    run_payload = base64.b64decode(json.loads(store.path(root, tid, "run").read_bytes())["payload"])
    assert v["decision"]["run"]["sha256"] == attest.sha256(run_payload)
    text = fila(root, "verify", tid)
    assert text.exit_code == 0 and "applied by alice" in text.output and "chained to the run" in text.output

    # A reject is signed too, chained to its own run.
    other = run_task(root, "echo x >> other.txt", "other.txt")
    assert fila(root, "reject", other, "--by", "bob", "-m", "no").exit_code == 0
    code, v = verify(root, other)
    assert code == 0 and v["decision"]["action"] == "rejected" and v["decision"]["by"] == "bob", v


def test_the_envelopes_verify_with_independent_verifiers(root: Root) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from google.protobuf import json_format
    from in_toto_attestation.v1 import statement_pb2
    from in_toto_attestation.v1.statement import Statement
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey

    tid = run_task(root)
    assert apply(root, tid).exit_code == 0
    pub = json.loads((keys.keys_dir(root) / keys.PUBLIC).read_text())
    ssl_key = SSlibKey.from_dict(pub.pop("keyid"), pub)
    raw_key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(ssl_key.keyval["public"]))
    for kind in ("run", "decision"):
        doc = json.loads(store.path(root, tid, kind).read_bytes())
        env = Envelope.from_dict(json.loads(json.dumps(doc)))
        assert list(env.verify([ssl_key], 1)) == [ssl_key.keyid]
        # DSSE v1 by hand: PAE(type, body), then ed25519 (raises InvalidSignature when wrong).
        body, ptype = base64.b64decode(doc["payload"]), doc["payloadType"].encode()
        pae = b"DSSEv1 %d %b %d %b" % (len(ptype), ptype, len(body), body)
        raw_key.verify(base64.b64decode(doc["signatures"][0]["sig"]), pae)
        pb = json_format.Parse(body, statement_pb2.Statement())
        Statement.copy_from_pb(pb).validate()  # the in-toto attestation library's own check
        assert pb.subject[0].digest["sha256"] == record(root, tid)["patch_sha256"]
        assert pb.predicate_type.endswith(f"/provenance/{kind}/v1")
    # The independent verifier refuses what fila refuses: one byte of the body changed.
    doc = json.loads(store.path(root, tid, "run").read_bytes())
    body = base64.b64decode(doc["payload"]).replace(b'"exit_code":0', b'"exit_code":1', 1)
    doc["payload"] = base64.b64encode(body).decode()
    from securesystemslib.exceptions import VerificationError

    with pytest.raises(VerificationError):
        Envelope.from_dict(doc).verify([ssl_key], 1)


def _edit_record(r: Root, tid: str, change: Callable[[dict], None]) -> None:
    path = r.record_path(tid)
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=2))


def _record_changed(r: Root, tid: str) -> None:
    _edit_record(r, tid, lambda d: d["attempts"][0]["image"].update(id="sha256:" + "0" * 64))


def _patch_changed(r: Root, tid: str) -> None:
    # DIFF.patch and the record's sha256 of it changed together: only the statement still knows.
    rec = record(r, tid)
    path = r.path / rec["patch_path"]
    data = path.read_bytes().replace(b"+world", b"+WORLD")
    path.write_bytes(data)
    _edit_record(r, tid, lambda d: d.update(patch_sha256=attest.sha256(data)))


def _policy_changed(r: Root, tid: str) -> None:
    # A looser policy put in place and the record made to name it.
    pol = json.loads((r.policies_dir / "default.json").read_text())
    data = json.dumps({**pol, "network": "bridge"}).encode()
    (r.policies_dir / "default.json").write_bytes(data)
    _edit_record(r, tid, lambda d: d["policy"].update(sha256=attest.sha256(data)))


def _statement_changed(r: Root, tid: str) -> None:
    path = store.path(r, tid, "run")
    doc = json.loads(path.read_bytes())
    body = base64.b64decode(doc["payload"]).replace(b'"network":"none"', b'"network":"bridge"', 1)
    doc["payload"] = base64.b64encode(body).decode()
    path.write_text(json.dumps(doc))


def _untrusted_key(r: Root, tid: str) -> None:
    from securesystemslib.signer import CryptoSigner

    from fila.provenance import envelope

    stmt = payload(store.path(r, tid, "run").read_bytes())  # the same statement, another key
    store.write(r, tid, "run", envelope.sign(stmt, CryptoSigner.generate_ed25519()))


TAMPERING = [
    pytest.param(_record_changed, "attempts[0].image.id: signed", id="record"),
    pytest.param(_patch_changed, "DIFF.patch hashes to sha256", id="patch"),
    pytest.param(_policy_changed, "policy.sha256: signed", id="policy"),
    pytest.param(_statement_changed, "signature does not verify", id="statement"),
    pytest.param(_untrusted_key, "which is not trusted in the queue root", id="untrusted-key"),
]


@pytest.mark.parametrize(("tamper", "named"), TAMPERING)
def test_tampering_is_refused_by_verify_and_apply_naming_what_does_not_match(
    root: Root, tamper: Callable[[Root, str], None], named: str
) -> None:
    tid = run_task(root)
    code, v = verify(root, tid)
    assert code == 0 and v["state"] == "verified", v  # the untampered counterpart
    tamper(root, tid)
    code, v = verify(root, tid)
    assert code == 4 and v["state"] == "failed" and any(named in p for p in v["problems"]), v
    res = apply(root, tid)
    assert res.exit_code == 4 and named in res.output and "provenance does not verify" in res.output, (
        res.output
    )
    assert (root.path / "greeting.txt").read_text() == GREETING  # nothing was written
    assert record(root, tid)["status"] == "needs_review"
    shown = fila(root, "review", tid, "--no-pager", "--json")
    assert json.loads(shown.stdout)["provenance"]["state"] == "failed"


def test_a_statement_replayed_for_another_task_is_refused(root: Root) -> None:
    a = run_task(root)
    b = run_task(root, "echo world > greeting.txt")  # the same change: the same DIFF.patch bytes
    assert record(root, a)["patch_sha256"] == record(root, b)["patch_sha256"]
    assert verify(root, b)[0] == 0
    store.write(root, b, "run", store.path(root, a, "run").read_bytes())
    code, v = verify(root, b)
    assert code == 4 and any(f"task {a}'s, not task {b}'s" in p for p in v["problems"]), v
    res = apply(root, b)
    assert res.exit_code == 4 and "replayed" in res.output, res.output
    assert apply(root, a).exit_code == 0  # its own task's statement still verifies and applies


def test_a_decision_chained_to_another_run_is_refused(root: Root) -> None:
    a = run_task(root)
    b = run_task(root, "echo x >> other.txt", "other.txt")
    assert fila(root, "reject", a, "--by", "bob").exit_code == 0
    assert verify(root, a)[0] == 0  # the decision chained to its own run verifies
    signer = keys.signer_of(root)
    forged = attest.decision_envelope(get_record(root, a), store.path(root, b, "run").read_bytes(), signer,
                                      base=None, host="h")  # fmt: skip
    store.write(root, a, "decision", forged)
    code, v = verify(root, a)
    assert code == 4 and any("the decision chains to run statement" in p for p in v["problems"]), v


def test_a_missing_statement_is_refused_once_keys_are_trusted_and_nothing_is_asked_before(
    tmp_path: Path,
) -> None:
    plain = make_project(tmp_path / "plain")
    tid = run_task(plain)
    code, v = verify(plain, tid)
    assert code == 1 and v["state"] == "unsigned" and not store.path(plain, tid, "run").exists()
    assert apply(plain, tid).exit_code == 0  # provenance off: apply as before

    signed = make_project(tmp_path / "signed")
    assert fila(signed, "keys", "init").exit_code == 0
    tid = run_task(signed)
    assert verify(signed, tid)[0] == 0
    store.path(signed, tid, "run").unlink()
    code, v = verify(signed, tid)
    assert code == 4 and "no run statement" in v["problems"][0], v
    assert apply(signed, tid).exit_code == 4
    env = {**FAKE, "FILA_FAKE_DIR": str(tmp_path / "boxes")}
    failed = fila(signed, "submit", "--engine", "shell", "--command", "exit 3", "--target", "greeting.txt")
    fila(signed, "run", "--once", env=env)
    code, v = verify(signed, failed.stdout.strip())
    assert code == 1 and v["note"] == "the task never reached review", v


def test_verify_with_no_queue_at_hand_checks_the_files_against_a_key(root: Root, tmp_path: Path) -> None:
    tid = run_task(root)
    assert apply(root, tid).exit_code == 0
    out = tmp_path / "out"
    out.mkdir()
    patch = out / "DIFF.patch"
    patch.write_bytes((root.path / record(root, tid)["patch_path"]).read_bytes())
    pub = keys.keys_dir(root) / keys.PUBLIC
    args = ["verify", "--patch", str(patch), "--attestation", str(store.path(root, tid, "run")),
            "--attestation", str(store.path(root, tid, "decision")), "--key", str(pub)]  # fmt: skip
    res = fila(root, *args)
    assert res.exit_code == 0 and "verified (run and decision)" in res.output, res.output
    assert f"task {tid}" in res.output

    other = tmp_path / "other"
    other.mkdir()
    assert fila(other, "init").exit_code == 0 and fila(other, "keys", "init").exit_code == 0
    res = fila(root, *args[:-1], str(keys.keys_dir(Root.at(other)) / keys.PUBLIC))
    assert res.exit_code == 4 and "not trusted in the --key files" in res.output, res.output
    patch.write_bytes(patch.read_bytes().replace(b"+world", b"+w0rld"))
    res = fila(root, *args)
    assert res.exit_code == 4 and "the patch changed after signing" in res.output, res.output
    res = fila(root, "verify", tid, "--patch", str(patch))
    assert res.exit_code == 2 and "together" in res.output


def test_keys_init_keeps_its_key_and_refuses_a_key_others_can_read(root: Root) -> None:
    first = json.loads(fila(root, "keys", "init", "--json").stdout)
    assert first["made"] is False  # made by the fixture, kept
    tid = run_task(root)
    assert verify(root, tid)[0] == 0
    (keys.keys_dir(root) / keys.PRIVATE).chmod(0o644)
    unsigned = run_task(root, "echo x >> other.txt", "other.txt")  # still reaches review, unsigned
    said = [json.loads(line) for line in root.events_path(unsigned).read_text().splitlines()]
    assert any(e["event"] == "provenance not signed" and "mode 644" in e["reason"] for e in said), said
    assert verify(root, unsigned)[0] == 4
    res = fila(root, "apply", tid, "--yes")
    assert res.exit_code == 0, res.output  # the landing and decision stand; the statement is not signed
    assert "not signed" in res.output and "mode 644" in res.output, res.output


def test_the_published_predicate_schema_is_the_models_and_accepts_what_fila_signs(root: Root) -> None:
    import jsonschema

    from fila.provenance.predicate import schema

    published = json.loads(
        (Path(__file__).resolve().parents[1] / "schemas" / "provenance.schema.json").read_text()
    )
    assert published == schema(), "schemas/provenance.schema.json is stale: `fila schema provenance > ...`"
    assert json.loads(fila(root, "schema", "provenance").stdout) == published
    tid = run_task(root)
    assert apply(root, tid).exit_code == 0
    for kind in ("run", "decision"):
        jsonschema.validate(payload(store.path(root, tid, kind).read_bytes())["predicate"], published)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"facts": {}}, published)


def test_apply_writes_the_statements_beside_the_landing_and_they_verify_there(
    root: Root, tmp_path: Path
) -> None:
    tid = run_task(root)
    dest = tmp_path / "project" / "attestations"  # made, with its parent, once applied
    res = fila(root, "apply", tid, "--yes", "--by", "alice", "--attestations", str(dest), "--json")
    assert res.exit_code == 0, res.output
    run, dec = dest / f"{tid}.run.intoto.json", dest / f"{tid}.decision.intoto.json"
    assert json.loads(res.stdout)["attestations"] == [str(run), str(dec)]
    assert run.read_bytes() == store.path(root, tid, "run").read_bytes()
    assert dec.read_bytes() == store.path(root, tid, "decision").read_bytes()
    patch = tmp_path / "DIFF.patch"
    patch.write_bytes((root.path / record(root, tid)["patch_path"]).read_bytes())
    pub = keys.keys_dir(root) / keys.PUBLIC
    res = fila(root, "verify", "--patch", str(patch), "--attestation", str(run), "--attestation", str(dec),
               "--key", str(pub))  # fmt: skip
    assert res.exit_code == 0 and "verified (run and decision)" in res.output, res.output

    # refused before anything lands: a symlink, a file, a task with no run statement
    other = run_task(root, "echo other > other.txt", "other.txt")
    (tmp_path / "link").symlink_to(dest)
    (tmp_path / "file").write_text("x\n")
    for bad, why in (("link", "is a symlink"), ("file", "is not a directory")):
        res = fila(root, "apply", other, "--yes", "--attestations", str(tmp_path / bad))
        assert res.exit_code == 2 and why in res.output, res.output
        assert record(root, other)["status"] == "needs_review"
    store.path(root, other, "run").unlink()
    (
        keys.keys_dir(root) / keys.TRUSTED
    ).unlink()  # provenance off: apply would land it, but there is nothing to write
    res = fila(root, "apply", other, "--yes", "--attestations", str(dest))
    assert res.exit_code == 2 and "has no run statement" in res.output, res.output
    assert (
        record(root, other)["status"] == "needs_review" and not (dest / f"{other}.run.intoto.json").exists()
    )
    assert fila(root, "apply", other, "--yes").exit_code == 0
