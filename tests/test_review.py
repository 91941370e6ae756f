"""`fila review` on a real Docker engine: what a person reads is the recorded DIFF.patch, made
inert (no escape sequence reaches the terminal or the browser), with the warnings that matter."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from fila.core.layout import Root
from fila.review import report as review
from tests.support.cli import fila, run_shell

pytestmark = pytest.mark.docker

HOSTILE_NAMES = r"""printf 'x\033]0;pwned\007\033[2J\n' > "$(printf 'evil\033[31mname')"
printf 'bidi \342\200\256 reversed\n' >> greeting.txt
echo engine says hi
"""


@pytest.fixture
def proj(proj: Root) -> Path:
    """The shared queue root (conftest), as the path this module's tests build on."""
    return proj.path


@pytest.mark.quick
def test_review_shows_summary_and_diff_without_color_or_pager_off_a_terminal(proj: Path) -> None:
    tid = run_shell(proj, "sed -i 's/hello/world/' greeting.txt")
    res = fila(proj, "review", tid)
    assert res.exit_code == 0, res.output
    out = res.stdout
    for expected in (f"task      {tid}  (needs_review)", "engine    shell", "image     fila/shell",
                     "policy    default sha256:", "timings   ", "diff      1 file, +1 -1",
                     "(verified)", "modified  greeting.txt", "-hello", "+world"):  # fmt: skip
        assert expected in out, expected
    # The phases in the order docs/ci.md documents them (the record's order): start-up and claim
    # come before prepare now, so the line no longer starts with it.
    line = next(ln for ln in out.splitlines() if ln.startswith("timings   "))
    keys = [part.split()[0] for part in line.removeprefix("timings   ").split(", ")]
    documented = ["startup", "claim", "begin", "validate", "prepare", "run", "create", "start_wait",
                  "remove", "diff", "check", "total"]  # fmt: skip
    assert {"prepare", "run", "diff", "total"} <= set(keys) and keys == [k for k in documented if k in keys]
    assert "\x1b" not in out  # no color when stdout is not a terminal


def test_review_escapes_control_characters_in_names_and_content(proj: Path) -> None:
    tid = run_shell(proj, HOSTILE_NAMES)
    res = fila(proj, "review", tid)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "evil\\x1b[31mname" in out or "evil\\033[31mname" in out
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in out
    assert "\\u202e" in out
    text = review.render_text(review.load(Root.at(proj), tid), color=True)
    # Only fila's own color codes are left once those are removed.
    assert "\x1b" not in re.sub(r"\x1b\[(?:\d+)?m", "", text)
    assert "\x1b[32m+bidi \\u202e reversed\x1b[0m" in text


def test_review_warns_about_sensitive_paths_executables_symlinks_and_binaries(proj: Path) -> None:
    cmd = """set -e
mkdir -p .github/workflows; echo 'on: push' > .github/workflows/ci.yml
echo '{}' > package-lock.json; echo 'all:' > Makefile; echo 'alias ls=rm' > .bashrc
printf '#!/bin/sh\\n' > tool.sh; chmod +x tool.sh
ln -s greeting.txt link; ln -s ../../etc/passwd escape
printf '\\000\\001\\377' > blob.bin
echo world > greeting.txt
"""
    tid = run_shell(proj, cmd)
    res = fila(proj, "review", tid, "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    warnings = "\n".join(got["warnings"])
    for expected in ("sensitive path (CI config): .github/workflows/ci.yml",
                     "sensitive path (lockfile): package-lock.json",
                     "sensitive path (build script): Makefile", "sensitive path (dotfile): .bashrc",
                     "adds an executable: tool.sh", "adds a symlink: link -> greeting.txt",
                     "adds a symlink: escape -> ../../etc/passwd (a symlink pointing outside the "
                     "project; apply will refuse it)", "binary file: blob.bin"):  # fmt: skip
        assert expected in warnings, expected
    assert not any(w.endswith(": greeting.txt") for w in got["warnings"])  # nothing special
    assert got["verified"] is True and got["patch_sha256"] == got["record"]["patch_sha256"]
    assert {f["path"]: f["kind"] for f in got["files"]}["tool.sh"] == "new"


def test_review_warns_when_the_patch_is_over_the_policy_limit(proj: Path) -> None:
    tid = run_shell(proj, "echo world > greeting.txt")
    policy = proj / "policies" / "default.json"
    data = json.loads(policy.read_text())
    data["max_diff_bytes"] = 10  # the policy was tightened after the run
    policy.write_text(json.dumps(data))
    got = json.loads(fila(proj, "review", tid, "--json").stdout)
    assert any("above the policy's max_diff_bytes (10)" in w for w in got["warnings"])


def test_review_refuses_a_tampered_patch(proj: Path) -> None:
    tid = run_shell(proj, "echo world > greeting.txt")
    p = proj / "sandbox" / "jobs" / tid / "DIFF.patch"
    p.write_bytes(p.read_bytes() + b"+one more line\n")
    res = fila(proj, "review", tid)
    assert res.exit_code == 4
    assert "does not match the sha256 in the record" in res.stderr
    assert "+world" not in res.stdout
    assert fila(proj, "review", tid, "--html").exit_code == 4
    assert not (proj / "sandbox" / "jobs" / tid / "REVIEW.html").exists()


@pytest.mark.quick
def test_review_html_is_one_self_contained_file(proj: Path) -> None:
    tid = run_shell(proj, HOSTILE_NAMES + "printf '\\000\\377' > blob.bin\n")
    res = fila(proj, "review", tid, "--html")
    assert res.exit_code == 0, res.output
    path = Path(res.stdout.strip())
    assert path == proj / "sandbox" / "jobs" / tid / "REVIEW.html"
    page = path.read_text()
    assert page.startswith("<!doctype html>")
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=|url\(|@import""", page, re.I)  # no external asset
    assert "\x1b" not in page and "\x07" not in page and "\u202e" not in page
    assert "evil\\x1b[31mname" in page and "\\u202e" in page
    assert '<tr class="add">' in page and '<tr class="ctx">' in page
    assert "engine says hi" in page  # the tail of the log
    assert "binary file: blob.bin" in page
    assert hashlib.sha256((path.parent / "DIFF.patch").read_bytes()).hexdigest() in page
    assert page.count("<html") == 1 and page.rstrip().endswith("</html>")


def test_review_pages_through_pager_only_when_asked(
    proj: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tid = run_shell(proj, "echo world > greeting.txt")
    text = review.render_text(review.load(Root.at(proj), tid), color=False)
    out = tmp_path / "paged.txt"
    monkeypatch.setenv("PAGER", f"sh -c 'cat > {out}'")
    review.page(text, enabled=True)
    assert out.read_text() == text
    review.page(text, enabled=False)
    assert capsys.readouterr().out == text
    monkeypatch.setenv("PAGER", str(tmp_path / "no-such-pager"))
    review.page(text, enabled=True)  # a missing pager falls back to printing
    assert capsys.readouterr().out == text


def test_review_of_a_task_that_failed_before_any_diff(proj: Path) -> None:
    (proj / "doomed.txt").write_text("x\n")
    res = fila(proj, "submit", "--engine", "shell", "--command", "true", "--target", "doomed.txt")
    tid = res.stdout.strip()
    (proj / "doomed.txt").unlink()  # the target is gone when the task is claimed
    fila(proj, "run", "--once")
    res = fila(proj, "review", tid)
    assert res.exit_code == 0, res.output
    assert "(failed)" in res.stdout and "diff      none" in res.stdout
    assert "this diff cannot be applied" in res.stdout


def test_ci_steps_work_without_a_terminal(proj: Path) -> None:
    """The steps of docs/ci.md: submit, run --once --json, review --html, apply --yes."""
    res = fila(proj, "submit", "--engine", "shell", "--command", "echo world > greeting.txt",
               "--target", "greeting.txt", "--id", "ci-task")  # fmt: skip
    assert res.exit_code == 0
    fila(proj, "submit", "--engine", "shell", "--command", "exit 9", "--target", "greeting.txt",
         "--id", "ci-fails")  # fmt: skip
    res = fila(proj, "run", "--once", "--json")
    assert res.exit_code == 1  # some task failed
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert {(r["id"], r["status"]) for r in lines} == {("ci-task", "needs_review"), ("ci-fails", "failed")}
    res = fila(proj, "review", "ci-task", "--html", "--json")
    assert Path(json.loads(res.stdout)["html"]).is_file()
    res = fila(proj, "apply", "ci-task", "--yes", "--by", "ci", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["written"] == ["greeting.txt"]
    assert fila(proj, "reject", "ci-fails", "--reason", "engine failed").exit_code == 0


def test_blank_glyph_letters_are_shown_escaped() -> None:
    from fila.review.report import inert
    from fila.workspace.fswalk import escape_name

    assert inert("exec(\u3164)") == "exec(\\u3164)"
    assert escape_name("a\u2800.txt") == "a\\u2800.txt"
    assert inert("tab\tand é stay") == "tab\tand é stay"
