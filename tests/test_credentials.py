"""A credential fila knows (a route's key, an engine's secret) never reaches DIFF.patch, `fila
diff`, REVIEW.html, the record or the project, whichever encoding it took: it is replaced by a
marker, the review warns, and apply refuses the task unless the person allows the marker to land.

The engine is the shell engine on real Docker under `network: allowlist` with one route; the key
reaches work/ as an echoing upstream would hand it over (the command spells it in octal escapes,
so the task file itself never holds it). The diff's own cases call compute_diff directly.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import subprocess
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import quote

import pytest

from fila.core.models import EngineReport, ErrorInfo, ErrorKind, ImageRef, Policy
from fila.workspace import secretscan
from fila.workspace.diff import compute_diff
from tests.support.cli import fila, run_shell, submit_shell
from tests.support.policy import write_policy
from tests.support.project import make_project, record

KEY_VAR = "FILA_TEST_CREDENTIAL_KEY"
KEY = f'sk-fila-{secrets.token_hex(12)}/+x"y'
MARKER = secretscan.marker("route anthropic")


def forms(key: str) -> dict[str, bytes]:
    """The key as an engine might save it: raw, base64 after 1 and 2 other bytes (both
    alphabets), URL-encoded, inside a JSON document."""
    raw = key.encode()
    return {
        "raw": raw,
        "base64 at offset 1": base64.b64encode(b"x" + raw),
        "urlsafe base64 at offset 2": base64.urlsafe_b64encode(b"ab" + raw),
        "url": quote(key, safe="").encode(),
        "json": json.dumps({"k": key}).encode(),
    }


def text_with(key: str) -> bytes:
    return b"".join(b"%s: %s\n" % (name.encode(), v) for name, v in forms(key).items())


def assert_clean(data: bytes | str, where: str = "", key: str = KEY) -> None:
    """None of the forms of `key` in data (nor its base64 cores at any offset)."""
    b = data.encode() if isinstance(data, str) else data
    for needle in secretscan.encodings(key):
        assert needle not in b, (where, needle)


# -- the needles --------------------------------------------------------------------------------


def test_every_encoding_of_a_credential_is_found_and_short_values_are_not_looked_for() -> None:
    scanner = secretscan.Scanner([secretscan.Credential("route r", KEY), secretscan.Credential("x", "abc")])
    assert scanner.skipped == ["x"]
    for name, encoded in forms(KEY).items():
        for pad in (b"", b"q", b"qq", b"qqq"):  # any offset inside a longer text
            masked = scanner.mask(pad + encoded + b"tail")
            assert masked.startswith(pad) and secretscan.marker("route r") in masked, name
    for k in range(6):  # base64 of a longer text, the key at every alignment, both alphabets
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            assert scanner.find(enc(os.urandom(k) + KEY.encode() + os.urandom(3)))
    assert scanner.mask(b"abc and an ordinary line") == b"abc and an ordinary line"


def test_a_record_is_scrubbed_field_by_field_and_left_as_it_is_when_clean() -> None:
    scanner = secretscan.Scanner([secretscan.Credential("route anthropic", KEY)])
    report = EngineReport(message=f"upstream said: {json.dumps(KEY)}", turns=3, extra_field=[KEY])
    err = ErrorInfo(kind=ErrorKind.auth, message=f"bad key {quote(KEY, safe='')}")
    counts: Counter[str] = Counter()
    got = scanner.scrub({"report": report, "error": err, "warnings": ["fine", KEY]}, counts)
    assert_clean(json.dumps([got["report"].model_dump(), got["error"].model_dump(), got["warnings"]]))
    assert got["report"].turns == 3 and got["error"].kind == ErrorKind.auth
    assert counts == {"route anthropic": 4}
    clean = EngineReport(message="nothing to hide")
    assert scanner.scrub(clean) is clean


# -- the diff, computed directly ---------------------------------------------------------------


def job(tmp_path: Path, work: dict[str, bytes]) -> Path:
    d = tmp_path / "job"
    (d / "input").mkdir(parents=True)
    (d / "work").mkdir()
    (d / "input" / "greeting.txt").write_bytes(b"hello\n")
    (d / "work" / "greeting.txt").write_bytes(b"hello\n")
    for rel, data in work.items():
        (d / "work" / rel).write_bytes(data)
    return d


POLICY = Policy.model_validate({"max_timeout_ms": 60_000, "default_timeout_ms": 60_000})


def test_a_diff_without_a_credential_is_the_same_patch_with_the_scanner(tmp_path: Path) -> None:
    d = job(tmp_path, {"greeting.txt": b"world\n", "new.bin": b"\0\1 binary"})
    scanner = secretscan.Scanner([secretscan.Credential("route anthropic", KEY)])
    plain = compute_diff(d, policy=POLICY, scratch=tmp_path / "s", out_name="PLAIN.patch")
    scanned = compute_diff(d, policy=POLICY, scratch=tmp_path / "s", credentials=scanner)
    assert scanned.credentials is None and scanned.sha256 == plain.sha256
    assert scanned.patch_path.read_bytes() == plain.patch_path.read_bytes()


def test_a_credential_in_text_binary_large_files_names_and_links_is_replaced_in_the_patch(
    tmp_path: Path,
) -> None:
    big = os.urandom(1 << 20)[: (1 << 20) - 7] + KEY.encode() + b"\0" * 100  # streamed, cut mid-key
    d = job(
        tmp_path, {"creds.txt": text_with(KEY), "blob.bin": b"\0\1" + KEY.encode() + b"\xff", "big.bin": big}
    )
    os.symlink(KEY, d / "work" / "link")
    named = f"sk-name-{secrets.token_hex(8)}"  # a name cannot hold KEY's "/"
    (d / "work" / f"file-{named}.txt").write_bytes(b"x\n")
    scanner = secretscan.Scanner(
        [secretscan.Credential("route anthropic", KEY), secretscan.Credential("engine secret", named)]
    )
    res = compute_diff(d, policy=POLICY, scratch=tmp_path / "s", credentials=scanner)
    patch = res.patch_path.read_bytes()
    assert_clean(patch)
    assert_clean(patch, "name", named)
    assert MARKER in patch and b"file-[fila: credential removed: engine secret].txt" in patch
    assert res.credentials is not None
    # 5 forms in creds.txt, 1 in each binary file and the link's target; the name 3 times in the
    # patch text (diff --git, +++), where it is replaced too
    assert res.credentials.counts == {"route anthropic": 5 + 1 + 1 + 1, "engine secret": 3}
    files = res.credentials.files
    assert sorted(files) == ["big.bin", "blob.bin", "creds.txt", "link"]
    assert files["blob.bin"] == hashlib.sha256(b"\0\1" + MARKER + b"\xff").hexdigest()
    assert files["big.bin"] == hashlib.sha256(big.replace(KEY.encode(), MARKER)).hexdigest()
    assert files["link"] == hashlib.sha256(MARKER).hexdigest()
    assert hashlib.sha256(patch).hexdigest() == res.sha256
    # The same work/ gives the same bytes: the marker is fixed, so the sha256 is too.
    again = compute_diff(
        d, policy=POLICY, scratch=tmp_path / "s", out_name="AGAIN.patch", credentials=scanner
    )
    assert again.sha256 == res.sha256


def test_escaped_wrapped_trimmed_and_non_ascii_forms_are_found_in_the_patch(tmp_path: Path) -> None:
    long_key = "sk-ant-api03-" + secrets.token_urlsafe(72)  # base64 wraps it at 76 columns
    spaced = f"  sk-fila-{secrets.token_hex(8)}\r"  # as a CRLF env file leaves it: the gateway trims
    accented = f"sk-fila-\u00e9{secrets.token_hex(8)}"
    partial_json = long_key[:3] + "\\u00" + format(ord(long_key[3]), "02x") + long_key[4:]
    mixed_pct = quote(KEY, safe="").replace("%2F", "%2f")  # one escape lowercase, one uppercase
    files = {
        "wrapped.txt": base64.encodebytes(b"Authorization: " + long_key.encode()),
        "partial-json.txt": b'{"k": "' + partial_json.encode() + b'"}\n',
        "partial-url.txt": b"k=" + KEY.replace("s", "%73", 1).encode() + b"\n",
        "mixed-url.txt": b"k=" + mixed_pct.encode() + b"\n",
        "trimmed.txt": spaced.strip().encode() + b"\n",
    }
    d = job(tmp_path, files)
    (d / "work" / f"n-{accented}.txt").write_bytes(b"x\n")  # git C-quotes the name: \303\251
    scanner = secretscan.Scanner(
        [
            secretscan.Credential("route anthropic", KEY),
            secretscan.Credential("route openai", long_key),
            secretscan.Credential("engine variable SPACED", spaced),
            secretscan.Credential("engine secret", accented),
        ]
    )
    res = compute_diff(d, policy=POLICY, scratch=tmp_path / "s", credentials=scanner)
    patch = res.patch_path.read_bytes()
    assert res.credentials is not None
    assert set(res.credentials.files) >= set(files), res.credentials.files
    assert res.credentials.counts["engine secret"] >= 1 and b"n-[fila: credential removed" in patch
    assert base64.b64encode(b"Authorization: " + long_key.encode())[20:60] not in patch.replace(b"\n", b"")
    for value in (KEY, long_key, spaced.strip()):
        assert_clean(patch, value, value)
    assert accented.encode() not in patch and b"\\303\\251" not in patch


# -- end to end: run, review, apply ------------------------------------------------------------


def octal(data: bytes) -> str:
    return "".join(f"\\{c:03o}" for c in data)


@pytest.fixture
def proj(tmp_path: Path, shell_image: ImageRef, monkeypatch: pytest.MonkeyPatch) -> Path:
    make_project(tmp_path, {"creds.txt": "none yet\n"})
    (tmp_path / "blob.bin").write_bytes(b"\0none yet")
    policy = {
        "network": "allowlist",
        "max_timeout_ms": 60_000,
        "default_timeout_ms": 30_000,
        "egress": {"routes": {"anthropic": {"credential": KEY_VAR}}},
    }
    write_policy(tmp_path, "routed", policy)
    monkeypatch.setenv(KEY_VAR, KEY)
    return tmp_path


def run(root: Path, command: str, *targets: str) -> str:
    return run_shell(root, command, *targets, extra=("--policy", "routed"))


@pytest.mark.docker
def test_a_change_without_a_credential_is_reviewed_and_applied_as_usual(proj: Path) -> None:
    tid = run(proj, "echo world > greeting.txt", "greeting.txt")
    rec = record(proj, tid)
    assert rec["credentials_in_diff"] is None
    assert not any("credential" in w for w in rec["warnings"]), rec["warnings"]
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 0, res.output
    assert (proj / "greeting.txt").read_text() == "world\n"


@pytest.mark.docker
@pytest.mark.quick
def test_a_known_credential_in_the_changes_is_masked_flagged_and_refused_unless_allowed(proj: Path) -> None:
    blob = b"\0\1" + KEY.encode() + b"\xff"
    cmd = (
        f"printf '{octal(text_with(KEY))}' > creds.txt; printf '{octal(blob)}' > blob.bin; "
        f"echo world > greeting.txt; printf 'log: {octal(base64.b64encode(b'x' + KEY.encode()))}\\n'"
    )
    assert KEY not in cmd
    tid = run(proj, cmd, "greeting.txt", "creds.txt", "blob.bin")
    job = proj / "sandbox" / "jobs" / tid
    rec = record(proj, tid)
    # The record: counted per credential, the masked files' sha256, a warning; never the value.
    assert rec["credentials_in_diff"]["counts"] == {"route anthropic": 6}
    assert sorted(rec["credentials_in_diff"]["files"]) == ["blob.bin", "creds.txt"]
    assert any("known credential" in w and "--allow-credential" in w for w in rec["warnings"])
    # DIFF.patch, `fila diff`, show, review and REVIEW.html: the marker, never the key.
    patch = (job / "DIFF.patch").read_bytes()
    assert MARKER in patch
    diff = fila(proj, "diff", tid)
    assert diff.exit_code == 0 and MARKER.decode() in diff.stdout
    assert "known credential" in diff.stderr and "--allow-credential" in diff.stderr
    show = fila(proj, "show", tid)
    review = fila(proj, "review", tid, "--no-pager")
    assert "known credential" in show.stdout and "known credential" in review.stdout
    html = fila(proj, "review", tid, "--html")
    page = Path(html.stdout.strip()).read_text()
    assert "known credential" in page and MARKER.decode() in page
    log = (proj / rec["log_path"]).read_bytes()
    assert b"log: " in log and b"***" in log
    seen = {
        "DIFF.patch": patch,
        "fila diff": diff.stdout,
        "show": show.stdout,
        "review": review.stdout,
        "review --json": fila(proj, "review", tid, "--json").stdout,
        "REVIEW.html": page,
        "record": (proj / "fila" / "out" / f"{tid}.json").read_bytes(),
        "log": log,
    }
    for name, text in seen.items():
        assert_clean(text, name)
    # apply refuses, naming what and where, and writes nothing; --json carries the refusal.
    before = {p: (proj / p).read_bytes() for p in ("greeting.txt", "creds.txt", "blob.bin")}
    res = fila(proj, "apply", tid, "--yes")
    assert res.exit_code == 4, res.output
    assert (
        "known credential" in res.stderr and "creds.txt" in res.stderr and "--allow-credential" in res.stderr
    )
    as_json = fila(proj, "apply", tid, "--yes", "--json")
    err = json.loads(as_json.stdout)
    assert as_json.exit_code == 4 and err["error"] == "CredentialInDiff" and err["exit_code"] == 4
    assert {p: (proj / p).read_bytes() for p in before} == before
    assert record(proj, tid)["status"] == "needs_review"
    # With the override: what was reviewed lands, the marker in the key's place, and it says so.
    ok = fila(proj, "apply", tid, "--yes", "--allow-credential")
    assert ok.exit_code == 0, ok.output
    assert "creds.txt landed with fila's marker" in ok.stderr
    assert (proj / "greeting.txt").read_text() == "world\n"
    assert (proj / "blob.bin").read_bytes() == b"\0\1" + MARKER + b"\xff"
    landed = (proj / "creds.txt").read_bytes()
    assert landed.count(MARKER) == 5 and landed.startswith(b"raw: " + MARKER + b"\n")
    assert_clean(landed)
    assert record(proj, tid)["status"] == "applied"


@pytest.mark.docker
def test_the_evidence_recovery_keeps_of_a_dead_run_is_masked_and_flagged_too(proj: Path) -> None:
    # The key also names a file (its "/" makes a directory): the path is the credential.
    top = KEY.split("/")[0]
    cmd = (
        f"printf '{octal(KEY.encode())}' > creds.txt; mkdir -p \"$(printf '{octal(top.encode())}')\"; "
        f"printf x > \"$(printf '{octal(KEY.encode())}')\""
    )
    tid = submit_shell(proj, cmd, "greeting.txt", "creds.txt", extra=("--policy", "routed"))
    # The worker dies after the container exited, before its diff: recovery reads work/.
    env = {**os.environ, "FILA_CRASH_AT": "after_exit"}
    crashed = subprocess.run(
        [sys.executable, "-c", "from fila.cli import main; main()", "run", "--once", "--root", str(proj)],
        env=env, capture_output=True, timeout=180,
    )  # fmt: skip
    assert crashed.returncode == -9, crashed.stderr
    assert fila(proj, "recover").exit_code == 0
    rec = record(proj, tid)
    assert rec["status"] == "needs_human" and rec["patch_path"], rec
    assert rec["credentials_in_diff"]["counts"]["route anthropic"] >= 2  # the content, the name
    assert "known credential" in rec["diagnosis"]
    patch = (proj / rec["patch_path"]).read_bytes()
    assert MARKER in patch
    for name, text in {
        "DIFF.patch": patch,
        "record": (proj / "fila" / "out" / f"{tid}.json").read_bytes(),
        "show": fila(proj, "show", tid).stdout,
        "diff": fila(proj, "diff", tid).stdout,
    }.items():
        assert_clean(text, name)
