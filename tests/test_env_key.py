"""An environment's key and its setup script (docs/environments.md, "The key", "The setup"),
without containers: the key moves with exactly what the setup depends on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fila.core.errors import InvalidInput
from fila.core.models import AllowEntry, SetupPolicy
from fila.env import key as keys
from fila.env.build import script
from fila.env.spec import EnvSpec, Step


def _project(tmp_path: Path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "requirements.txt").write_text("pytest==8.3.0\n")
    (tmp_path / "app.py").write_text("x = 1\n")
    return tmp_path


def _key(project: Path, spec: EnvSpec, setup: SetupPolicy | None = None) -> str:
    digest = keys.content(spec, {"image_id": "sha256:abc"}, keys.read_inputs(project, spec))
    return keys.compute(digest, setup or SetupPolicy())


def test_the_key_moves_with_the_inputs_commands_and_network_and_not_with_the_rest(tmp_path: Path) -> None:
    project = _project(tmp_path)
    install = Step(name="s", shell="pip install -r requirements.txt")
    spec = EnvSpec(image="fila/testenv:latest", setup=[install], inputs=["requirements.txt"])
    first = _key(project, spec)
    assert _key(project, spec) == first  # the same inputs: the same key
    (project / "app.py").write_text("x = 2\n")  # a file the setup does not read
    assert _key(project, spec) == first
    (project / "requirements.txt").write_text("pytest==8.3.1\n")  # a changed lockfile
    changed = _key(project, spec)
    assert changed != first
    other = spec.model_copy(update={"setup": [Step(name="s", shell="pip install -e .")]})
    assert _key(project, other) != changed
    assert _key(project, spec, SetupPolicy(allow=[AllowEntry(host="pypi.test", port=8080)])) != changed
    other_base = keys.content(spec, {"image_id": "sha256:def"}, keys.read_inputs(project, spec))
    assert keys.compute(other_base, SetupPolicy()) != changed
    # Time and resources are not what the setup made: the same key.
    assert _key(project, spec, SetupPolicy(timeout_ms=1000, memory="1g")) == changed


def test_an_input_through_a_link_or_outside_the_project_is_refused(tmp_path: Path) -> None:
    project = _project(tmp_path / "p")
    (tmp_path / "secret").write_text("host file\n")
    assert keys.read_inputs(project, EnvSpec(image="x", inputs=["requirements.txt"])).files
    (project / "lock.txt").symlink_to(tmp_path / "secret")
    with pytest.raises(InvalidInput, match="symlink"):
        keys.read_inputs(project, EnvSpec(image="x", inputs=["lock.txt"]))
    with pytest.raises(InvalidInput, match="outside the project"):
        keys.read_inputs(project, EnvSpec(image="x", inputs=["../secret"]))
    (project / "linked").symlink_to(tmp_path)  # a directory link out of the project on the way
    with pytest.raises(InvalidInput, match="passes through a symlink"):
        keys.read_inputs(project, EnvSpec(image="x", inputs=["linked/secret"]))


def test_the_setup_script_runs_each_form_as_the_spec_says(tmp_path: Path) -> None:
    """The script the setup container runs, here with a real sh: a string by sh -c, an argv as it
    is (quoting kept), a parallel step's commands at once, and a failing one fails the setup."""
    out = tmp_path / "out"
    spec = EnvSpec(
        image="x",
        setup=[
            Step(name="a", shell=f"echo 'one two' > {out}.a"),
            Step(name="b", argv=["sh", "-c", 'printf "%s|" "$@" > "$0"', f"{out}.b", "x y", "$HOME", "'"]),
            Step(name="c", parallel=[Step(name="c:1", shell=f"touch {out}.c1"), Step(name="c:2", argv=["touch", f"{out}.c2"])]),  # noqa: E501
        ],
    )  # fmt: skip
    body = (
        script(spec)
        .replace("mkdir -p /job/work\n", "")
        .replace("cp -a /fila-setup/inputs/. /job/work/\n", "")
    )
    body = body.replace("cd /job/work\n", f"cd {tmp_path}\n")
    res = subprocess.run(["sh", "-c", body], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out.a").read_text() == "one two\n"
    assert (tmp_path / "out.b").read_text() == "x y|$HOME|'|"
    assert (tmp_path / "out.c1").exists() and (tmp_path / "out.c2").exists()
    assert "== fila setup: c" in res.stdout and "== fila setup: done" in res.stdout
    both = [Step(name="p:ok", shell="true"), Step(name="p:bad", shell="exit 3")]
    after = Step(name="after", shell=f"touch {out}.after")
    failing = spec.model_copy(update={"setup": [Step(name="p", parallel=both), after]})
    body = (
        script(failing)
        .replace("mkdir -p /job/work\n", "")
        .replace("cp -a /fila-setup/inputs/. /job/work/\n", "")
    )
    res = subprocess.run(
        ["sh", "-c", body.replace("cd /job/work\n", f"cd {tmp_path}\n")], capture_output=True, text=True
    )
    assert res.returncode != 0 and "failed: p:bad" in res.stderr
    assert not (tmp_path / "out.after").exists()


def test_a_build_context_digests_the_same_on_a_runner_that_laid_it_out_again(tmp_path: Path) -> None:
    """A PostgreSQL runner lays the targets out 0755/0644 by the owner's execute bit and makes no
    empty directory: the build context's digest (and the archive the build is given) takes only
    that, so the submitter's pinned digest and the runner's agree; an execute bit still counts."""
    from fila.env.spec import Build

    spec = EnvSpec(build=Build(dockerfile="Dockerfile", context="."))

    def tree(root: Path, mode: int, empty_dir: bool) -> dict[str, str]:
        root.mkdir()
        (root / "Dockerfile").write_text("FROM scratch\nCOPY . /src\n")
        (root / "src").mkdir()
        (root / "src" / "run.sh").write_text("echo hi\n")
        (root / "src" / "run.sh").chmod(mode)
        if empty_dir:
            (root / "cache").mkdir()
        return keys.context_digest(root, spec, lambda _rel, _is_dir: False)

    submitter = tree(tmp_path / "sub", 0o775, empty_dir=True)  # group-writable, as a checkout may be
    assert tree(tmp_path / "runner", 0o755, empty_dir=False) == submitter
    assert tree(tmp_path / "noexec", 0o664, empty_dir=True) != submitter
