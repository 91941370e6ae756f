"""A project's environment as declared (docs/environments.md, "Declaring"): devcontainer.json read
as the Dev Containers spec reads it, fila's own form, and every path of the declaration checked
against the project without following a link. No container: the reference reading is the Dev
Containers CLI's own (`devcontainer read-configuration`), run from npm in one Node process."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from fila.core.errors import InvalidEnvironment
from fila.core.untrusted import MAX_DEPTH
from fila.env import declare, devcontainer
from fila.env.spec import PROJECT_PATH, Declared, Step

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).parent / "fixtures" / "env" / "read_configurations.js"
CLI_VERSION = (
    "0.89.0"  # @devcontainers/cli, the reference implementation; pinned: the driver loads its bundle
)
CLI_CACHE = REPO / ".venv" / "cache" / f"devcontainers-cli-{CLI_VERSION}"


def project(tmp: Path, files: dict[str, str]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    return tmp


def dc(tmp: Path, text: str, *, rel: str = ".devcontainer/devcontainer.json", **files: str) -> Declared:
    """find() on a project holding the devcontainer.json `text` (and `files`)."""
    got = declare.find(project(tmp, {rel: text, **files}))
    assert got is not None
    return got


def refused(tmp: Path, text: str, *, rel: str = ".devcontainer/devcontainer.json", **files: str) -> str:
    with pytest.raises(InvalidEnvironment) as e:
        declare.find(project(tmp, {rel: text, **files}))
    return str(e.value)


def refused_at(p: Path, explicit: str | None = None) -> str:
    with pytest.raises(InvalidEnvironment) as e:
        declare.find(p, explicit)
    return str(e.value)


def test_jsonc_comments_and_trailing_commas_are_read_and_strings_are_kept(tmp_path: Path) -> None:
    got = dc(
        tmp_path,
        """// a project's environment
        {
          /* the base */ "image": "python:3.12-slim", // trailing comment
          "name": "a // b /* c */ \\" // d",
          "containerEnv": {"A": "1", /* between */ "B": "x,}",
            // a comment between the last comma and the brace
          },
          "onCreateCommand": ["echo", "//", "/*",],
        }""",
    )
    assert got.form == "devcontainer" and got.source == ".devcontainer/devcontainer.json"
    assert got.spec.image == "python:3.12-slim"
    assert got.spec.name == 'a // b /* c */ " // d'
    assert got.spec.env == {"A": "1", "B": "x,}"}
    assert got.spec.setup == [Step(name="onCreateCommand", argv=["echo", "//", "/*"])]
    assert got.warnings == []


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"image": "debian", "x": [,]}', "malformed JSON"),  # a comma after `[` is no trailing comma
        ('{"image": "debian", "x": [1,,]}', "malformed JSON"),
        ('{"image": "debian",,}', "malformed JSON"),
        ("{'image': 'debian'}", "malformed JSON"),  # JSON5's single quotes are not JSONC
        ('{image: "debian"}', "malformed JSON"),
        ('{"image": "debian", "x": 0x10}', "malformed JSON"),
        ('{"image": "debian"} /* never closed', "a /* comment is not closed (line 1)"),
        ('{"image": "debian", "x": NaN}', "NaN is not a JSON number"),
        ('{"image": "debian", "image": "alpine"}', "key 'image' appears twice"),
        ('["image", "debian"]', "holds a JSON array, not an object"),
        ('"debian"', "holds a JSON string, not an object"),
        ('{"image": "debian", "x": ' + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "}", "nesting deeper"),
    ],
)
def test_what_jsonc_does_not_mean_is_refused(tmp_path: Path, text: str, said: str) -> None:
    assert dc(tmp_path / "ok", '{"image": "debian", "x": [1,],}').spec.image == "debian"
    assert said in refused(tmp_path / "bad", text)


def test_a_huge_declaration_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    padding = " " * (devcontainer.MAX_DECLARATION_BYTES - 100)
    assert dc(tmp_path / "ok", '{"image": "debian"}' + padding).spec.image == "debian"
    said = refused(tmp_path / "bad", '{"image": "debian"}' + padding + " " * 200)
    assert f"above the {devcontainer.MAX_DECLARATION_BYTES}-byte limit" in said


def test_the_lifecycle_commands_in_each_form_become_the_setup_in_the_specs_order(tmp_path: Path) -> None:
    got = dc(
        tmp_path,
        """{"image": "debian",
            "postCreateCommand": {"deps": "pip install -r requirements.txt", "tools": ["make", "tools"],
                                  "none": ""},
            "updateContentCommand": ["npm", "ci"],
            "onCreateCommand": "echo one && echo two"}""",
    )
    assert got.spec.setup == [
        Step(name="onCreateCommand", shell="echo one && echo two"),
        Step(name="updateContentCommand", argv=["npm", "ci"]),
        Step(
            name="postCreateCommand",
            parallel=[
                Step(name="postCreateCommand:deps", shell="pip install -r requirements.txt"),
                Step(name="postCreateCommand:tools", argv=["make", "tools"]),
            ],
        ),
    ]
    empty = dc(tmp_path / "empty", '{"image": "debian", "onCreateCommand": "", "postCreateCommand": {}}')
    assert empty.spec.setup == []
    said = refused(tmp_path / "bad", '{"image": "debian", "postCreateCommand": {"x": 3}}')
    assert "key 'postCreateCommand.x' must be a string, an array of strings or an object" in said
    assert "key 'onCreateCommand[1]' must be a string" in refused(
        tmp_path / "bad2", '{"image": "debian", "onCreateCommand": ["a", 1]}'
    )


def test_each_key_that_would_loosen_the_sandbox_is_named_in_a_warning_and_never_obeyed(
    tmp_path: Path,
) -> None:
    base = {"image": "debian", "postCreateCommand": "true", "customizations": {"fila": {"inputs": []}}}
    plain = dc(tmp_path / "plain", json.dumps(base))
    assert plain.warnings == []
    loose = {key: f"LOOSE-{key}" for key in devcontainer.IGNORED}
    loose["build"] = {"options": ["--network=host"], "cacheFrom": "LOOSE-cache"}
    loose["customizations"] = {"vscode": {"extensions": ["LOOSE-ext"]}, "fila": {"inputs": []}}
    got = dc(tmp_path / "loose", json.dumps({**base, **loose}))
    for key in devcontainer.IGNORED:
        assert any(w.startswith(f"key {key!r} is ignored: ") for w in got.warnings), key
    assert any("'build.options' is ignored" in w for w in got.warnings)
    assert any("customizations for vscode are ignored" in w for w in got.warnings)
    assert any("put the tools in the image or the Dockerfile" in w for w in got.warnings)
    assert got.spec == plain.spec
    assert "LOOSE" not in got.spec.model_dump_json() and "--network" not in got.spec.model_dump_json()


@pytest.mark.parametrize("key", ["dockerComposeFile", "initializeCommand"])
def test_compose_and_host_commands_are_refused(tmp_path: Path, key: str) -> None:
    assert dc(tmp_path / "ok", '{"image": "debian"}').spec.image == "debian"
    said = refused(tmp_path / "bad", json.dumps({"image": "debian", key: "touch /tmp/pwned"}))
    assert f"key {key!r} is refused" in said
    assert "devcontainer.json" in said


def test_an_unknown_key_is_a_warning_and_the_workspace_folder_is_mapped(tmp_path: Path) -> None:
    got = dc(tmp_path, '{"image": "debian", "someFutureKey\\u001b[31m": 1, "workspaceFolder": "/src"}')
    assert "key 'someFutureKey\\\\x1b[31m' is unknown to fila and ignored" in got.warnings
    assert any(f"'workspaceFolder' (/src) is mapped to {PROJECT_PATH}" in w for w in got.warnings)


def test_the_specs_variables_are_substituted_where_fila_means_the_same_and_host_lookups_refused(
    tmp_path: Path,
) -> None:
    got = dc(
        tmp_path,
        """{"image": "debian",
            "containerEnv": {"TOOLS": "${containerWorkspaceFolder}/tools",
                             "BASE": "${containerWorkspaceFolderBasename}"},
            "postCreateCommand": "echo ${HOME} ${unknownThing:x} > ${containerWorkspaceFolder}/out"}""",
    )
    assert got.spec.env == {"TOOLS": f"{PROJECT_PATH}/tools", "BASE": PurePosixPath(PROJECT_PATH).name}
    assert got.spec.setup[0].shell == f"echo ${{HOME}} ${{unknownThing:x}} > {PROJECT_PATH}/out"
    for i, (where, variable, said) in enumerate(
        [
            ("containerEnv", "${localEnv:AWS_SECRET_ACCESS_KEY}", "reads the host's environment"),
            ("postCreateCommand", "${env:HOME}", "reads the host's environment"),
            ("onCreateCommand", "${localWorkspaceFolder}", "is a path on the host"),
            ("containerEnv", "${localWorkspaceFolderBasename}", "is a path on the host"),
            (
                "postCreateCommand",
                "${containerEnv:PATH}",
                "does not substitute the container's own variables",
            ),
            ("image", "${devcontainerId}", "names one host's container"),
        ]
    ):
        value: Any = {"X": variable} if where == "containerEnv" else variable
        doc = {"image": "debian", where: value}
        message = refused(tmp_path / str(i), json.dumps(doc))
        assert said in message and variable in message


def test_the_dockerfile_and_context_are_made_project_relative_the_cli_way(tmp_path: Path) -> None:
    got = dc(
        tmp_path / "a",
        '{"build": {"dockerfile": "Dockerfile", "context": "..", "args": {"V": "1"}, "target": "dev"}}',
        **{".devcontainer/Dockerfile": "FROM debian\n"},
    )
    assert got.spec.build is not None and got.spec.image is None
    assert (got.spec.build.dockerfile, got.spec.build.context) == (".devcontainer/Dockerfile", ".")
    assert (got.spec.build.args, got.spec.build.target) == ({"V": "1"}, "dev")
    # Without a context, the CLI builds in the Dockerfile's own folder.
    sub = dc(
        tmp_path / "b",
        '{"build": {"dockerfile": "img/Dockerfile"}}',
        **{".devcontainer/img/Dockerfile": "FROM x"},
    )
    assert sub.spec.build is not None
    assert (sub.spec.build.dockerfile, sub.spec.build.context) == (
        ".devcontainer/img/Dockerfile",
        ".devcontainer/img",
    )
    # The older top-level spelling, and `image` beside a Dockerfile (the Dockerfile wins, as in the CLI).
    old = '{"image": "debian", "dockerFile": "Dockerfile", "context": "."}'
    legacy = dc(tmp_path / "c", old, rel=".devcontainer.json", Dockerfile="FROM x")
    assert legacy.spec.build is not None and legacy.spec.image is None
    assert (legacy.spec.build.dockerfile, legacy.spec.build.context) == ("Dockerfile", ".")
    assert any("key 'image' is ignored" in w for w in legacy.warnings)


def test_a_dockerfile_or_context_outside_the_project_or_through_a_symlink_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    project(outside, {"Dockerfile": "FROM debian\n"})
    files = {".devcontainer/Dockerfile": "FROM debian\n", "docker/Dockerfile": "FROM debian\n"}
    assert dc(
        tmp_path / "ok", '{"build": {"dockerfile": "../docker/Dockerfile", "context": "../docker"}}', **files
    )
    cases = {
        "up": ('{"build": {"dockerfile": "../../outside/Dockerfile"}}', "is outside the project"),
        "ctx": ('{"build": {"dockerfile": "Dockerfile", "context": "../.."}}', "is outside the project"),
        "abs": (json.dumps({"build": {"dockerfile": str(outside / "Dockerfile")}}), "is an absolute path"),
        "missing": ('{"build": {"dockerfile": "Nope"}}', "does not exist in the project"),
    }
    for name, (text, said) in cases.items():
        assert said in refused(tmp_path / name, text, **files), name
    # A link in the project: to a Dockerfile outside, to a directory outside, even to one inside.
    for name, link, target, text in [
        ("file", "docker/Linked", outside / "Dockerfile", '{"build": {"dockerfile": "../docker/Linked"}}'),
        ("dir", "linked", outside, '{"build": {"dockerfile": "../linked/Dockerfile"}}'),
        ("ctx", "ctx", outside, '{"build": {"dockerfile": "Dockerfile", "context": "../ctx"}}'),
        ("inside", "docker/Same", Path("Dockerfile"), '{"build": {"dockerfile": "../docker/Same"}}'),
    ]:
        p = project(tmp_path / f"link-{name}", files)
        (p / link).symlink_to(target)
        said = refused(p, text)
        assert "fila follows no link in the project" in said, name


def test_the_declaration_itself_may_not_be_a_link(tmp_path: Path) -> None:
    outside = project(tmp_path / "outside", {"devcontainer.json": '{"image": "debian"}'})
    p = project(tmp_path / "file", {})
    (p / ".devcontainer.json").symlink_to(outside / "devcontainer.json")
    assert "is a symlink" in (refused_at(p))
    d = project(tmp_path / "dir", {})
    (d / ".devcontainer").symlink_to(outside)
    assert "fila follows no link" in (refused_at(d))


def test_inputs_must_be_regular_files_of_the_project_reached_through_no_link(tmp_path: Path) -> None:
    outside = project(tmp_path / "outside", {"package-lock.json": "{}"})
    fila = {"inputs": ["package.json", "package-lock.json"]}
    text = json.dumps({"image": "node:20", "postCreateCommand": "npm ci", "customizations": {"fila": fila}})
    files = {"package.json": "{}", "package-lock.json": "{}"}
    assert dc(tmp_path / "ok", text, **files).spec.inputs == ["package.json", "package-lock.json"]
    p = project(tmp_path / "link", {".devcontainer/devcontainer.json": text, "package.json": "{}"})
    (p / "package-lock.json").symlink_to(outside / "package-lock.json")
    assert "input 'package-lock.json' is a symlink" in str(refused_at(p))
    d = project(tmp_path / "dir", {".devcontainer/devcontainer.json": text, "package.json": "{}"})
    (d / "package-lock.json").mkdir()
    assert "is a directory, not a regular file" in str(refused_at(d))
    big = project(tmp_path / "big", {".devcontainer/devcontainer.json": text, **files})
    os.truncate(big / "package-lock.json", declare.MAX_INPUT_BYTES + 1)  # sparse: costs nothing
    assert f"above the limit of {declare.MAX_INPUT_BYTES}" in str(refused_at(big))
    many = {
        "image": "debian",
        "customizations": {"fila": {"inputs": [f"f{i}" for i in range(declare.MAX_INPUTS + 1)]}},
    }
    assert f"above the limit of {declare.MAX_INPUTS}" in refused(tmp_path / "many", json.dumps(many))
    assert "is outside the project" in refused(
        tmp_path / "up", json.dumps({"image": "debian", "customizations": {"fila": {"inputs": ["../x"]}}})
    )


def test_without_inputs_the_dependency_files_present_are_taken_and_named(tmp_path: Path) -> None:
    files = {
        "package.json": "{}",
        "package-lock.json": "{}",
        "requirements-dev.txt": "",  # not a well-known name: not taken
        "requirements.txt": "pytest\n",
        "docker/Dockerfile": "FROM x",
        "docker/go.mod": "module x",
        "src/Cargo.toml": "",  # neither at the top nor in the context
    }
    text = (
        '{"build": {"dockerfile": "../docker/Dockerfile", "context": "../docker"}, '
        '"postCreateCommand": "npm ci"}'
    )
    got = dc(tmp_path, text, **files)
    assert got.spec.inputs == ["requirements.txt", "package.json", "package-lock.json", "docker/go.mod"]
    assert got.spec.provided == ["node_modules"]
    assert any("given the dependency files found, requirements.txt, package.json" in w for w in got.warnings)
    assert any("node_modules (beside package.json)" in w for w in got.warnings)
    # Declared ones are taken as they are; without a setup nothing reads them.
    chosen = (
        text[:-1]
        + ', "customizations": {"fila": {"inputs": ["package.json"], "provided": ["web/node_modules"]}}}'
    )
    mine = dc(tmp_path / "mine", chosen, **files)
    assert (mine.spec.inputs, mine.spec.provided, mine.warnings) == (
        ["package.json"],
        ["web/node_modules"],
        [],
    )
    bare = dc(tmp_path / "bare", '{"image": "debian"}', **files)
    assert (bare.spec.inputs, bare.spec.provided) == ([], [])


@pytest.mark.parametrize(
    ("provided", "said"),
    [
        (".", "is the whole project"),
        ("../x", "is outside the project"),
        ("a/../../x", "is outside the project"),
        ("plain", "is a regular file"),
    ],
)
def test_provided_directories_stay_inside_the_project(tmp_path: Path, provided: str, said: str) -> None:
    def doc(p: str) -> str:
        return json.dumps({"image": "debian", "customizations": {"fila": {"provided": [p]}}})

    assert dc(tmp_path / "ok", doc("node_modules"), plain="x").spec.provided == ["node_modules"]
    assert said in refused(tmp_path / "bad", doc(provided), plain="x")
    linked = project(tmp_path / "link", {".devcontainer/devcontainer.json": doc("node_modules")})
    (linked / "node_modules").symlink_to(tmp_path)
    assert "is a symlink" in (refused_at(linked))


def test_fila_form_is_strict_json_of_the_spec(tmp_path: Path) -> None:
    spec = {
        "name": "py",
        "image": "python:3.12-slim",
        "env": {"PIP_NO_CACHE_DIR": "1"},
        "setup": [{"name": "deps", "shell": "pip install -r requirements.txt"}],
        "inputs": ["requirements.txt"],
        "provided": [".venv"],
    }
    got = dc(
        tmp_path / "ok", json.dumps(spec), rel="fila-environment.json", **{"requirements.txt": "pytest\n"}
    )
    assert got.form == "fila" and got.source == "fila-environment.json" and got.warnings == []
    assert got.spec.model_dump(exclude_defaults=True) == spec
    for name, (doc, said) in {
        "extra": ({**spec, "runArgs": ["--privileged"]}, "field 'runArgs': Extra inputs are not permitted"),
        "type": ({**spec, "setup": "make"}, "field 'setup'"),
        "both": (
            {**spec, "build": {"dockerfile": "Dockerfile"}},
            "exactly one of `image` and `build`, not both",
        ),
        "neither": ({k: v for k, v in spec.items() if k != "image"}, "exactly one of `image` and `build`"),
        "image": ({**spec, "image": "fila/../../x"}, "is not an image reference"),
        "list": ([spec], "is not a JSON object"),
        "no command": ({**spec, "setup": [{"name": "x"}]}, "setup[0] ('x') has no command"),
        "two": ({**spec, "setup": [{"name": "x", "shell": "a", "argv": ["a"]}]}, "has `shell` and `argv`"),
        "deep": (
            {
                **spec,
                "setup": [
                    {"name": "x", "parallel": [{"name": "y", "parallel": [{"name": "z", "shell": "a"}]}]}
                ],
            },
            "one level deep",
        ),
    }.items():
        assert said in refused(tmp_path / name, json.dumps(doc), rel="fila-environment.json"), name
    commented = "// a comment\n" + json.dumps(spec)
    assert "malformed JSON" in refused(tmp_path / "jsonc", commented, rel="fila-environment.json")


def test_where_a_project_declares_its_environment(tmp_path: Path) -> None:
    assert declare.find(project(tmp_path / "none", {"README": "x"})) is None
    everywhere = {
        ".devcontainer/devcontainer.json": '{"image": "one"}',
        ".devcontainer.json": '{"image": "two"}',
        "fila-environment.json": '{"image": "three"}',
        "env/python/devcontainer.json": '{"image": "four"}',
    }
    p = project(tmp_path / "all", everywhere)
    order = []
    for rel in [".devcontainer/devcontainer.json", ".devcontainer.json", "fila-environment.json"]:
        got = declare.find(p)
        assert got is not None
        order.append((got.source, got.spec.image))
        (p / rel).unlink()
    assert order == [
        (".devcontainer/devcontainer.json", "one"),
        (".devcontainer.json", "two"),
        ("fila-environment.json", "three"),
    ]
    q = project(tmp_path / "explicit", everywhere)
    chosen = declare.find(q, "env/python/devcontainer.json")
    assert chosen is not None and (chosen.form, chosen.spec.image) == ("devcontainer", "four")
    assert declare.find(q, "none") is None
    assert "is outside the project" in str(refused_at(q, "../x.json"))
    assert "does not exist" in (refused_at(q, "nope.json"))


# The reference: the Dev Containers CLI's reading of the same files.

ORACLE_CASES: dict[str, dict[str, str]] = {
    "image-jsonc": {
        ".devcontainer/devcontainer.json": """// comments and trailing commas
        {
          "name": "py // not a comment", /* a block */
          "image": "mcr.microsoft.com/devcontainers/python:3.12",
          "workspaceFolder": "/job/work",
          "containerEnv": {"TOOLS": "${containerWorkspaceFolder}/tools", "MODE": "test",},
          "onCreateCommand": "pip install --user -r requirements.txt",
          "updateContentCommand": ["python", "-m", "pip", "install", "-e", ".",],
          "postCreateCommand": {"lint": "pip install ruff",
                                "hooks": ["git", "config", "core.hooksPath", ".githooks"]},
        }""",
    },
    "build": {
        ".devcontainer/devcontainer.json": """{
          "build": {"dockerfile": "Dockerfile", "context": "..", "args": {"NODE": "18",}, "target": "dev"},
          "postCreateCommand": "echo ${HOME} in ${containerWorkspaceFolderBasename}",
          "workspaceFolder": "/job/work",
        }""",
        ".devcontainer/Dockerfile": "FROM node:18\n",
    },
    "legacy": {
        ".devcontainer.json": '{"dockerFile": "Dockerfile", "context": ".", /* old */ '
        '"containerEnv": {"A": "a//b"}}',
        "Dockerfile": "FROM debian\n",
    },
}


def cli_bundle() -> Path:
    """The Dev Containers CLI's bundle, which scripts/oracle-up installs into the venv's cache (an
    install step of scripts/test: a test fetches nothing)."""
    bundle = (
        CLI_CACHE
        / "node_modules"
        / "@devcontainers"
        / "cli"
        / "dist"
        / "spec-node"
        / "devContainersSpecCLI.js"
    )
    if not bundle.exists():
        pytest.fail(
            f"the Dev Containers CLI {CLI_VERSION} is not installed in {CLI_CACHE}: "
            "run `bash scripts/oracle-up` (scripts/test does)"
        )
    return bundle


def as_devcontainer(step: Step) -> Any:
    """A setup step as the lifecycle command it came from."""
    if step.parallel is not None:
        return {s.name.partition(":")[2]: as_devcontainer(s) for s in step.parallel}
    return step.shell if step.shell is not None else step.argv


def test_fila_reads_devcontainer_json_as_the_dev_containers_cli_does(tmp_path: Path) -> None:
    bundle = cli_bundle()
    dirs = {name: project(tmp_path / name, files) for name, files in ORACLE_CASES.items()}
    run = subprocess.run(
        ["node", str(DRIVER), str(bundle)],
        input=json.dumps([str(d) for d in dirs.values()]),
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    results = {r["dir"]: r for r in json.loads(run.stdout)}
    for name, d in dirs.items():
        result = results[str(d)]
        assert result["code"] == 0, (name, run.stderr[-2000:])
        cli = json.loads(result["output"])["configuration"]
        ours = declare.find(d)
        assert ours is not None
        spec = ours.spec
        folder = PurePosixPath(ours.source).parent
        assert spec.name == cli.get("name"), name
        assert spec.image == (None if "dockerFile" in cli or "build" in cli else cli["image"]), name
        assert spec.env == cli.get("containerEnv", {}), name
        steps = {s.name: as_devcontainer(s) for s in spec.setup}
        assert steps == {k: cli[k] for k in devcontainer.SETUP_COMMANDS if k in cli}, name
        if spec.build is not None:
            build = cli.get("build", {})
            dockerfile = cli.get("dockerFile", build.get("dockerfile"))
            context = cli.get("context") if "dockerFile" in cli else build.get("context")
            assert spec.build.dockerfile == os.path.normpath(folder / dockerfile), name
            assert spec.build.context == os.path.normpath(folder / context), name
            assert (spec.build.args, spec.build.target) == (build.get("args", {}), build.get("target")), name


def test_a_provided_path_never_hides_the_projects_files_nor_becomes_a_pattern(tmp_path: Path) -> None:
    """A provided directory becomes a volume over the project's path and a deny rule: one holding
    the project's own files (a `tests/` the setup fakes would pass the check) or a pattern (`*`
    hides every directory from the job and its diff) is refused when the declaration is read."""

    def doc(*p: str) -> str:
        return json.dumps({"image": "debian", "customizations": {"fila": {"provided": list(p)}}})

    files = {"tests/run.sh": "exit 1\n", "node_modules/left/index.js": "1\n", "build/.keep": ""}
    # Allowed: a directory the project lacks, and a package manager's one it holds already.
    ok = dc(tmp_path / "ok", doc("dist", "node_modules"), **files)
    assert ok.spec.provided == ["dist", "node_modules"]
    assert "holds files of the project" in refused(tmp_path / "tests", doc("tests"), **files)
    assert "holds files of the project" in refused(tmp_path / "build", doc("build"), **files)
    for i, pattern in enumerate(["*", "x\\", "a/[bc]", "!keep", "#x", "a?"]):
        assert "pattern character" in refused(tmp_path / f"glob{i}", doc(pattern)), pattern


def test_provided_paths_parallel_commands_and_warnings_are_capped(tmp_path: Path) -> None:
    many = [f"d{i}" for i in range(declare.MAX_PROVIDED)]
    assert len(dc(tmp_path / "ok", json.dumps({"image": "debian", "customizations": {
        "fila": {"provided": many}}})).spec.provided) == declare.MAX_PROVIDED  # fmt: skip
    said = refused(tmp_path / "over", json.dumps({"image": "debian", "customizations": {
        "fila": {"provided": [*many, "one-more"]}}}))  # fmt: skip
    assert f"above the limit of {declare.MAX_PROVIDED}" in said
    cmds = {f"c{i}": "true" for i in range(declare.MAX_PARALLEL)}
    assert dc(tmp_path / "par", json.dumps({"image": "debian", "onCreateCommand": cmds})).spec.setup
    said = refused(
        tmp_path / "par-over", json.dumps({"image": "debian", "onCreateCommand": {**cmds, "x": "true"}})
    )
    assert f"above the limit of {declare.MAX_PARALLEL}" in said
    # A declaration of many unknown keys: the first warnings, then how many more.
    few = dc(tmp_path / "few", json.dumps({"image": "debian", **{f"k{i}": 1 for i in range(3)}}))
    assert len(few.warnings) == 3
    lots = dc(tmp_path / "lots", json.dumps({"image": "debian", **{f"k{i}": 1 for i in range(5000)}}))
    assert len(lots.warnings) == declare.MAX_WARNINGS + 1
    assert lots.warnings[-1] == f"and {5000 - declare.MAX_WARNINGS} more warnings, not shown"
