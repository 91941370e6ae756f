"""Text to a terminal: whatever fila prints that came from a task, a file name
in fila/in, a decision (--reason, --by, $FILA_USER) or a policy is shown escaped, bidi controls
included; ids never hold a control character. Checked on the bytes each command writes."""

from __future__ import annotations

import json
import shlex
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from fila.core.layout import Root
from fila.core.models import Task
from fila.core.states import valid_id
from fila.workspace.fswalk import inert
from tests.support.cli import fila
from tests.support.project import record

# ESC sequences (clear screen, set the window title, a CSI as one C1 byte), CR, the bidi
# overrides and isolates, marks, NUL, DEL, and HTML that must stay text in REVIEW.html.
HOSTILE = (
    "ok\x1b[2J\x1b]0;pwned\x07\rFAKE \u202eevil\u202c \u2066iso\u2069 \u200e\u200f\u061c"
    "\x00\x7f\x9b31m <img src=x onerror=alert(1)> end"
)
BIDI_NAME = "mallory\u202ecod.exe\u202c"  # no control character: a name may pass; shown escaped
PLAIN = "Alice Example: looks good, merging"


def raw_controls(data: bytes) -> list[str]:
    """Characters a terminal acts on or reorders instead of showing: C0/C1 controls (but newline
    and tab), DEL, format characters (bidi, zero-width), and bytes that are not UTF-8."""
    text = data.decode("utf-8", "surrogateescape")
    return [
        f"U+{ord(c):04X}"
        for c in text
        if (unicodedata.category(c) in ("Cc", "Cf") and c not in "\n\t") or 0xDC80 <= ord(c) <= 0xDCFF
    ]


def assert_inert(res: Any, what: str) -> None:
    assert not raw_controls(res.stdout_bytes), (what, "stdout", raw_controls(res.stdout_bytes), res.stdout)
    assert not raw_controls(res.stderr_bytes), (what, "stderr", raw_controls(res.stderr_bytes), res.stderr)


def test_the_one_escaping_function_covers_bidi_controls_and_keeps_plain_text() -> None:
    assert inert(PLAIN) == PLAIN  # allowed counterpart: shown as is
    for ch in [
        *map(chr, range(0x202A, 0x202F)),
        *map(chr, range(0x2066, 0x206A)),
        "\u200e",
        "\u200f",
        "\u061c",
    ]:
        assert inert(f"a{ch}b") == f"a\\u{ord(ch):04x}b"
    assert not raw_controls(inert(HOSTILE).encode())


def test_ids_may_not_hold_control_characters() -> None:
    assert valid_id("rename-greeting_1.2") and Task(id="ok-1", engine="shell", targets=["a"]).id == "ok-1"
    for bad in ("abc\n", "abc\r", "a\x1bb", "a\x00", "\u202eabc", ".", ".."):
        assert not valid_id(bad), repr(bad)


def test_refused_input_is_quoted_escaped_in_errors(root: Root) -> None:
    base = ["submit", "--engine", "shell", "--command", "true", "--target", "greeting.txt"]
    res = fila(root.path, *base, "--model", "plain-model", "--id", "plain-1")
    assert res.exit_code == 0 and res.stdout == "plain-1\n", res.output  # allowed counterpart
    assert "(model plain-model)" in fila(root.path, "show", "plain-1").stdout
    for opt in ("--model", "--id", "--policy", "--engine", "--project", "--target"):
        args = [a for a in base if a != "--target" and a != "greeting.txt"] if opt == "--target" else base
        res = fila(root.path, *args, opt, HOSTILE)
        assert_inert(res, f"submit {opt}")
        if opt == "--model" and res.exit_code == 0:  # a model name may be refused at intake, or shown escaped
            tid = res.stdout.strip()
            assert "\\x1b[2J" in fila(root.path, "show", tid).stdout
            for args in (["show", tid], ["ls"], ["review", tid, "--no-pager"]):
                assert_inert(fila(root.path, *args), " ".join(args))
            continue
        assert res.exit_code == 2 and "fila: error:" in res.stderr, (opt, res.output)
    res = fila(root.path, *base, "--id", "abc\n")
    assert res.exit_code == 2 and "id" in res.stderr, res.output
    assert_inert(res, "submit --id with a newline")
    (root.in_dir / "dropped.json").write_text(
        json.dumps({"id": "abc\n", "engine": "shell", "targets": ["x"]})
    )
    res = fila(root.path, "submit", str(root.in_dir / "dropped.json"))
    assert res.exit_code == 2, res.output
    assert_inert(res, "submit FILE with an id holding a newline")


def test_file_names_in_fila_in_and_a_hostile_prompt_are_shown_escaped(root: Root) -> None:
    text = HOSTILE.replace("\x00", "")  # a NUL is refused at submit as at claim (test_hostile_intake)
    res = fila(root.path, "submit", "--engine", "shell", "--command", text, "--prompt", text,
               "--target", "greeting.txt", "--id", "text-1")  # fmt: skip
    assert res.exit_code == 0, res.output  # prompt and command are text: accepted, quoted where shown
    (root.in_dir / f"{HOSTILE.replace(chr(0), '')}.json").write_text("{}")
    (root.in_dir / "\u202eevil.json").write_text("{}")
    for args in (["ls"], ["ls", "--json"], ["status"], ["status", "--json"], ["show", "text-1"],
                 ["show", "text-1", "--json"], ["review", "text-1", "--no-pager"],
                 ["review", "text-1", "--json"]):  # fmt: skip
        res = fila(root.path, *args)
        assert res.exit_code in (0, 1), (args, res.output)
        assert_inert(res, " ".join(args))
    assert "text-1  queued" in fila(root.path, "ls").stdout  # allowed counterpart, as is


@pytest.mark.docker
def test_a_hostile_decision_and_engine_output_reach_no_terminal_raw(
    root: Root, shell_image: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = HOSTILE.replace("\x00", "")  # a task file may not hold NUL (refused at claim); a decision may
    cmd = f"printf '%s\\n' {shlex.quote(text)} | tee greeting.txt"
    ids = []
    for n in range(3):
        res = fila(root.path, "submit", "--engine", "shell", "--command", cmd, "--target", "greeting.txt",
                   "--id", f"t{n}", "--prompt", text)  # fmt: skip
        assert res.exit_code == 0, res.output
        ids.append(res.stdout.strip())
    res = fila(root.path, "run", "--once")
    assert_inert(res, "run --once")
    assert all(record(root.path, t)["status"] == "needs_review" for t in ids), res.output

    # Allowed counterpart: a plain decision is shown as it was given.
    res = fila(root.path, "reject", "t0", "--reason", PLAIN, "--by", "alice")
    assert res.exit_code == 0 and res.stdout == f"rejected t0 by alice: {PLAIN}\n", res.output
    assert "decision:  rejected by alice at " in fila(root.path, "show", "t0").stdout
    assert fila(root.path, "show", "t0").stdout.rstrip().endswith(f": {PLAIN}")

    res = fila(root.path, "reject", "t1", "--reason", HOSTILE, "--by", BIDI_NAME)
    assert res.exit_code == 0, res.output
    assert_inert(res, "reject")
    assert record(root.path, "t1")["decision"]["reason"] == HOSTILE.strip(), (
        "recorded as given, shown escaped"
    )
    monkeypatch.setenv("FILA_USER", BIDI_NAME)
    res = fila(root.path, "apply", "t2", "--yes", "--reason", HOSTILE)
    assert res.exit_code == 0, res.output
    assert_inert(res, "apply")
    assert record(root.path, "t2")["decision"]["by"] == BIDI_NAME
    for t in ids:
        for args in (["show", t], ["review", t, "--no-pager"], ["review", t, "--json"],
                     ["logs", t, "--events"], ["ls"], ["status"]):  # fmt: skip
            res = fila(root.path, *args)
            assert res.exit_code == 0, (args, res.output)
            assert_inert(res, " ".join(args))
        res = fila(root.path, "review", t, "--html")
        html = Path(res.stdout.strip()).read_text()
        assert not raw_controls(html.encode()), raw_controls(html.encode())
        assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "by mallory\\u202ecod.exe\\u202c" in fila(root.path, "show", "t1").stdout
    assert b"\x1b[2J" in (root.logs_dir / "t1.log").read_bytes(), "the engine's output was hostile"


@pytest.mark.docker
def test_policy_names_from_the_policies_directory_are_shown_escaped(root: Root, docker_client: Any) -> None:
    (root.policies_dir / "plain-policy.json").write_text("{}")
    (root.policies_dir / "ev\x1b[31mil\u202ex.json").write_text("{}")
    res = fila(
        root.path,
        "submit",
        "--engine",
        "shell",
        "--command",
        "true",
        "-t",
        "greeting.txt",
        "--policy",
        "nope",
    )
    assert res.exit_code == 2 and "plain-policy" in res.stderr, res.output  # allowed counterpart, as is
    assert "ev\\x1b[31mil\\u202ex" in res.stderr
    assert_inert(res, "submit --policy nope (the hint lists the policies)")
    res = fila(root.path, "doctor", "--no-self-test")
    assert res.exit_code == 1 and "plain-policy" in res.stdout, res.output
    assert_inert(res, "doctor")
