"""Deny rules: the README's "never copied" list is the shipped policy's, and the rules mean what
they mean in a .gitignore (pathspec), proven on a real project copied into a job."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fila.core.errors import InvalidPolicy
from fila.queue.policy import denied_by, load_policy, narrow
from fila.workspace import jobdir
from tests.support.project import make_root, shell_task

REPO = Path(__file__).resolve().parent.parent


def readme_never_copied() -> list[str]:
    """The rules README.md lists after "the default policy never copies:", in order."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"the default policy\s+never copies:((?:\s*`[^`]+`[,.])+)", text)
    assert m, "README.md no longer lists what the default policy never copies"
    return re.findall(r"`([^`]+)`", m.group(1))


def test_readme_lists_exactly_what_the_shipped_policy_denies() -> None:
    shipped = json.loads((REPO / "policies" / "default.json").read_text())["deny"]
    listed = readme_never_copied()
    assert len(listed) > 10  # the parse found the list, not a fragment of it
    assert listed == shipped


# (rules, a path they deny, is it a directory, the rule that denies it, a neighbour they allow)
CASES = {
    "a name matches at any depth": (["*.pem"], "a/b/c/server.pem", False, "*.pem", "a/b/c/server.pem.txt"),
    "a directory rule matches nested dirs": (["build/"], "pkg/sub/build", True, "build/", "pkg/sub/builder"),
    "dir/ matches a directory, not a file so named": (["build/"], "out/build", True, "build/", "lib/build"),
    "/anchored matches only at the root": (
        ["/config.yml"],
        "config.yml",
        False,
        "/config.yml",
        "app/config.yml",
    ),
    "a rule with an inner slash is anchored": (
        ["docs/*.key"],
        "docs/a.key",
        False,
        "docs/*.key",
        "x/docs/a.key",
    ),
    "**/x matches at any depth": (["**/cache"], "a/b/cache", True, "**/cache", "a/b/cache2"),
    "a/**/b spans directories": (["a/**/b.txt"], "a/x/y/b.txt", False, "a/**/b.txt", "c/a/x/b.txt"),
    "!negation re-allows a file": (["*.key", "!public.key"], "private.key", False, "*.key", "public.key"),
    "!negation cannot re-allow inside a denied directory": (
        ["vault/", "!vault/readme.md"],
        "vault/readme.md",
        False,
        "vault/",
        "readme.md",
    ),
    "dotfiles match like any name": ([".env*"], "svc/.env.local", False, ".env*", "svc/env.local"),
    "a denied directory denies what is below it": ([".ssh/"], "home/.ssh/id", False, ".ssh/", "home/ssh/id"),
}


def _touch(base: Path, rel: str) -> None:
    p = base / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(rel + "\n")


def _copied_into_job(tmp_path: Path, deny: list[str] | None, files: list[str]) -> set[str]:
    """Make a project holding `files`, prepare a job of it under a policy with `deny` (the
    shipped one when None), and return the files that reached work/."""
    proj = tmp_path / "proj"
    proj.mkdir()
    root = make_root(proj).require()
    name = "default"
    if deny is not None:
        data = json.loads((REPO / "policies" / "default.json").read_text())
        data["deny"], name = deny, "rules"
        (root.policies_dir / "rules.json").write_text(json.dumps(data))
    for rel in files:
        _touch(proj, rel)
    task = shell_task(targets=["."], policy=name)
    policy, _ = load_policy(root, name)
    work = jobdir.prepare(root, "deny", task, policy, narrow(policy, task)).job_dir / "work"
    return {str(p.relative_to(work)) for p in work.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_deny_rules_have_gitignore_semantics(case: str, tmp_path: Path) -> None:
    rules, denied, is_dir, rule, allowed = CASES[case]
    assert denied_by(allowed, False, rules) is None
    assert denied_by(denied, is_dir, rules) == rule
    # The same in a job: the allowed neighbour is copied, the denied path (a directory is made
    # with a file inside, so only the file's absence shows the directory was skipped) is not.
    denied_file = denied + "/f" if is_dir else denied
    copied = _copied_into_job(tmp_path, rules, [denied_file, allowed])
    assert allowed in copied
    assert denied_file not in copied


def test_the_shipped_rules_deny_secrets_and_keep_their_lookalikes(tmp_path: Path) -> None:
    kept = ["src/env.py", "secrets", "docker/config.json", "notes/keys.md", "svn.txt", "app/.gitignore"]
    gone = {
        ".envrc": ".env*",
        "deploy/prod.env": "*.env",
        "home/.ssh/known_hosts": ".ssh/",
        "sub/.docker/config.json": "**/.docker/config.json",
        "lib/secrets/token": "secrets/",
        "deploy/id_ed25519": "id_*",
        "certs/tls.key": "*.key",
    }
    deny = json.loads((REPO / "policies" / "default.json").read_text())["deny"]
    assert {p: denied_by(p, False, deny) for p in kept} == dict.fromkeys(kept)
    assert {p: denied_by(p, False, deny) for p in gone} == gone
    copied = _copied_into_job(tmp_path, None, [*kept, *gone])
    assert set(kept) <= copied
    assert not set(gone) & copied


def test_a_rule_pathspec_cannot_read_is_an_invalid_policy() -> None:
    assert denied_by("a.txt", False, ["*.pem"]) is None
    with pytest.raises(InvalidPolicy, match="deny"):
        denied_by("a.txt", False, ["!"])


def test_a_policy_with_a_rule_pathspec_cannot_read_is_refused_when_loaded(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    good = json.loads((root.policies_dir / "default.json").read_text())
    (root.policies_dir / "fine.json").write_text(json.dumps(good))
    assert load_policy(root, "fine")[0].deny == good["deny"]
    bad = {**good, "deny": [*good["deny"], "!"]}
    (root.policies_dir / "broken.json").write_text(json.dumps(bad))
    with pytest.raises(InvalidPolicy, match="deny"):
        load_policy(root, "broken")
