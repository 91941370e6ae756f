"""Read a `devcontainer.json` as the Dev Containers spec reads it, into fila's one form
(docs/environments.md, "Declaring").

The file is JSON with comments: `//` and `/* */` comments and trailing commas, nothing else of
JSON5 (no single quotes, no bare keys, no hex numbers, no NaN), so a file fila reads means what it
means to the Dev Containers CLI, the reference implementation. Comments and trailing commas are
blanked out byte by byte (strings kept whole, line numbers kept for error messages) and the rest
goes through core.untrusted, the reader every JSON fila did not write goes through.

What is taken: `image`, `build` (or the older top-level `dockerFile`/`context`), `containerEnv`,
the three lifecycle commands that prepare a container, `name`, and fila's own settings under
`customizations.fila`: `inputs` and `provided`, relative to the project like every path of
EnvSpec (the spec's own `build.dockerfile` and `build.context` are relative to the
devcontainer.json's folder and are made relative to the project here). What would reach the
host or loosen the sandbox is refused (an error) or ignored with a warning naming the key and
why; it is never obeyed.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ValidationError

from ..core.errors import InvalidEnvironment
from ..core.text import escape_name
from ..core.untrusted import parse_json, read_capped
from .spec import PROJECT_PATH, Declared, EnvSpec, Step

MAX_DECLARATION_BYTES = 1 << 20  # a devcontainer.json is a few hundred bytes; 1 MiB is generous

# The commands that prepare a container, in the order the spec runs them once, at creation.
SETUP_COMMANDS = ("onCreateCommand", "updateContentCommand", "postCreateCommand")

# Keys refused outright: obeying them means running something on the host or another model.
REFUSED = {
    "initializeCommand": "it runs on the host, before any container exists; fila never runs a "
    "project's command on the host",
    "dockerComposeFile": "Docker Compose environments are not supported; declare one image or one "
    "Dockerfile (`image` or `build`)",
}

# Keys ignored with a warning: each would loosen the sandbox, reach the host, or does not belong
# to a setup that runs once. fila's own policy decides these, never the project.
IGNORED = {
    "runArgs": "extra `docker run` arguments would loosen the sandbox",
    "privileged": "a privileged container would loosen the sandbox",
    "capAdd": "added capabilities would loosen the sandbox",
    "securityOpt": "security options would loosen the sandbox",
    "mounts": "host mounts would expose the host",
    "workspaceMount": "the project is mounted by fila, never from a host path",
    "init": "fila decides the container's init process",
    "forwardPorts": "no port is published from a fila container",
    "appPort": "no port is published from a fila container",
    "portsAttributes": "no port is published from a fila container",
    "otherPortsAttributes": "no port is published from a fila container",
    "postStartCommand": "it runs at every start, not once: it is not a setup",
    "postAttachCommand": "it runs when an editor attaches: it is not a setup",
    "waitFor": "the setup's commands always run to their end before anything else",
    "remoteUser": "fila decides the user the engine runs as",
    "containerUser": "fila decides the user the container runs as",
    "updateRemoteUserUID": "fila decides the user the container runs as",
    "userEnvProbe": "the environment is containerEnv, read from no shell profile",
    "overrideCommand": "fila decides the container's command",
    "shutdownAction": "fila removes its containers itself",
    "hostRequirements": "the policy's limits decide the resources",
    "remoteEnv": "variables for the editor's processes; use containerEnv for the environment",
    "features": "each feature is an install script fetched from a registry, not run by fila; put "
    "the tools in the image or the Dockerfile",
    "service": "Docker Compose only",
    "runServices": "Docker Compose only",
    "secrets": "setup secrets are named in fila's policy, never in the project",
}

IGNORED_BUILD = {
    "options": "extra `docker build` arguments would loosen the build's sandbox",
    "cacheFrom": "the build uses only fila's own cache",
}

# `${name}` or `${name:arg...}` as the Dev Containers CLI matches it (non-greedy, one line).
_VARIABLE = re.compile(r"\$\{(.*?)\}")

# Comments and strings, so a `//` or a `/*` inside a string is kept; an unterminated block
# comment is matched on its own, to be refused.
_COMMENT = re.compile(rb'"(?:[^"\\]|\\.)*"|//[^\n\r]*|/\*.*?\*/|/\*', re.DOTALL)
# A comma before a closing bracket is a trailing comma; a comma right after `[`, `{`, `,` or `:`
# is none (`[,]` means nothing): it is matched first, kept, and left for json to refuse. Each
# alternative starts on a fixed character, so a long run of blanks is scanned once.
_TRAILING = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[{,:]\s*,|,(?=\s*[\]}])')


def strip_jsonc(raw: bytes, *, path: Path | str) -> bytes:
    """The JSON text of a JSON-with-comments document: every comment and trailing comma becomes
    blanks (newlines kept), nothing else changes. Works on UTF-8 bytes: no byte of a multi-byte
    character is ASCII, so no delimiter is found inside one."""

    def blank(m: re.Match[bytes]) -> bytes:
        text = m.group(0)
        if text.startswith(b'"'):
            return text
        if text == b"/*":
            line = raw.count(b"\n", 0, m.start()) + 1
            raise InvalidEnvironment(f"a /* comment is not closed (line {line})", path=path)
        return re.sub(rb"[^\n\r]", b" ", text)

    def comma(m: re.Match[bytes]) -> bytes:
        return b" " if m.group(0) == b"," else m.group(0)

    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark some editors write
    return _TRAILING.sub(comma, _COMMENT.sub(blank, raw))


def read(project: Path, rel: str) -> Declared:
    """The environment a project's devcontainer.json at `rel` (relative to the project) declares.
    Paths in it are made relative to the project; they are checked against the project by
    `declare`, not here. Raises InvalidEnvironment naming the key and why."""
    path = project / rel
    raw = read_capped(path, cap=MAX_DECLARATION_BYTES, kind="devcontainer.json", error=InvalidEnvironment)
    data = parse_json(
        strip_jsonc(raw, path=path), kind="devcontainer.json", error=InvalidEnvironment, path=path
    )
    return _Reader(path, PurePosixPath(rel).parent).declared(data, rel)


class _Reader:
    def __init__(self, path: Path, folder: PurePosixPath) -> None:
        self.path = path
        self.folder = folder  # the devcontainer.json's folder, relative to the project
        self.warnings: list[str] = []

    def fail(self, message: str, hint: str | None = None) -> InvalidEnvironment:
        return InvalidEnvironment(message, path=self.path, hint=hint)

    def declared(self, data: Any, rel: str) -> Declared:
        if not isinstance(data, dict):
            raise self.fail(
                f"devcontainer.json holds a JSON {_json_type(data)}, not an object",
                hint='write one object: {"image": "..."}',
            )
        for key, why in REFUSED.items():
            if key in data:
                raise self.fail(f"key {key!r} is refused: {why}")
        spec: dict[str, Any] = {}
        for key, value in data.items():
            if key in IGNORED:
                self.warnings.append(f"key {key!r} is ignored: {IGNORED[key]}")
            elif key == "name":
                spec["name"] = self.text(value, key)
            elif key == "containerEnv":
                spec["env"] = {
                    k: self.text(v, f"containerEnv.{k}") for k, v in self.mapping(value, key).items()
                }
            elif key == "workspaceFolder":
                if self.text(value, key) != PROJECT_PATH:
                    self.warnings.append(
                        f"key 'workspaceFolder' ({escape_name(value)[:200]}) is mapped to {PROJECT_PATH}: "
                        "the project is there in every container of the environment"
                    )
            elif key == "customizations":
                spec.update(self.customizations(value))
            elif key not in ("image", "build", "dockerFile", "context", *SETUP_COMMANDS):
                self.warnings.append(f"key {escape_name(key)[:100]!r} is unknown to fila and ignored")
        spec["setup"] = [
            step for key in SETUP_COMMANDS if key in data for step in self.command(data[key], key)
        ]
        self.base(data, spec)
        try:
            return Declared(
                spec=EnvSpec.model_validate(spec), source=rel, form="devcontainer", warnings=self.warnings
            )
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise self.fail(f"{where}: {first['msg']}") from None

    def base(self, data: dict[str, Any], spec: dict[str, Any]) -> None:
        """`image`, or a Dockerfile; the Dockerfile wins when both are there, as in the CLI."""
        build = self.mapping(data["build"], "build") if "build" in data else {}
        for key, why in IGNORED_BUILD.items():
            if key in build:
                self.warnings.append(f"key 'build.{key}' is ignored: {why}")
        for key in build:
            if key not in ("dockerfile", "context", "args", "target", *IGNORED_BUILD):
                self.warnings.append(
                    f"key {'build.' + escape_name(key)[:100]!r} is unknown to fila and ignored"
                )
        if "dockerFile" in data:  # the older spelling; the CLI reads it first, with `context`
            dockerfile, context, ctx_key = (
                self.text(data["dockerFile"], "dockerFile"),
                data.get("context"),
                "context",
            )
        elif "dockerfile" in build:
            dockerfile, context, ctx_key = (
                self.text(build["dockerfile"], "build.dockerfile"),
                build.get("context"),
                "build.context",
            )
        else:
            if "image" not in data:
                raise self.fail(
                    "devcontainer.json names neither `image` nor `build.dockerfile`",
                    hint="name the base image, or a Dockerfile to build it from",
                )
            spec["image"] = self.text(data["image"], "image")
            return
        if "image" in data:
            self.warnings.append(
                "key 'image' is ignored: the Dockerfile is built instead, as the Dev Containers CLI does"
            )
        dockerfile_rel = self.project_path(
            dockerfile, "build.dockerfile" if "dockerFile" not in data else "dockerFile"
        )
        if context is None:  # the CLI's default: the Dockerfile's own folder
            context_rel = PurePosixPath(dockerfile_rel).parent.as_posix()
        else:
            context_rel = self.project_path(self.text(context, ctx_key), ctx_key)
        out: dict[str, Any] = {"dockerfile": dockerfile_rel, "context": context_rel}
        if "args" in build:
            out["args"] = {
                k: self.text(v, f"build.args.{k}")
                for k, v in self.mapping(build["args"], "build.args").items()
            }
        if "target" in build:
            out["target"] = self.text(build["target"], "build.target")
        spec["build"] = out

    def project_path(self, value: str, key: str) -> str:
        """`value`, relative to the devcontainer.json's folder, as a path relative to the project;
        one that leaves the project is refused."""
        if PurePosixPath(value).is_absolute():
            raise self.fail(
                f"key {key!r} is an absolute path ({escape_name(value)[:200]})",
                hint="name it relative to the devcontainer.json's folder",
            )
        parts: list[str] = []
        for part in (*self.folder.parts, *PurePosixPath(value).parts):
            if part == "..":
                if not parts:
                    raise self.fail(
                        f"key {key!r} ({escape_name(value)[:200]}) is outside the project",
                        hint="the Dockerfile and the build context must be inside the project",
                    )
                parts.pop()
            elif part != ".":
                parts.append(part)
        return "/".join(parts) or "."

    def customizations(self, value: Any) -> dict[str, Any]:
        tools = self.mapping(value, "customizations")
        others = [escape_name(k)[:100] for k in tools if k != "fila"]
        if others:
            self.warnings.append(
                f"customizations for {', '.join(others)} are ignored: they are for other tools"
            )
        if "fila" not in tools:
            return {}
        fila = self.mapping(tools["fila"], "customizations.fila")
        out = {}
        for key, sub in fila.items():
            if key not in ("inputs", "provided"):
                raise self.fail(
                    f"key 'customizations.fila.{escape_name(key)[:100]}' is unknown",
                    hint="fila reads `inputs` (files the setup reads) and `provided` (directories it makes)",
                )
            if not isinstance(sub, list):
                raise self.fail(
                    f"key 'customizations.fila.{key}' must be a list of paths, not a JSON {_json_type(sub)}"
                )
            out[key] = [self.text(p, f"customizations.fila.{key}[{i}]") for i, p in enumerate(sub)]
        return out

    def command(self, value: Any, key: str) -> list[Step]:
        """A lifecycle command as setup steps: a string runs in a shell, an array as it is, an
        object's named commands (each string or array) at once, in one step."""
        if isinstance(value, dict):
            parallel = [
                s
                for name, sub in value.items()
                for s in self.one(sub, f"{key}:{escape_name(name)[:100]}", f"{key}.{name}")
            ]
            return [Step(name=key, parallel=parallel)] if parallel else []
        return self.one(value, key, key)

    def one(self, value: Any, name: str, key: str) -> list[Step]:
        try:
            if isinstance(value, str):
                command = self.text(value, key)
                return [Step(name=name, shell=command)] if command.strip() else []
            if isinstance(value, list):
                argv = [self.text(a, f"{key}[{i}]") for i, a in enumerate(value)]
                return [Step(name=name, argv=argv)] if argv else []
        except ValidationError as e:
            raise self.fail(f"key {key!r}: {e.errors()[0]['msg']}") from None
        raise self.fail(
            f"key {key!r} must be a string, an array of strings or an object, not a JSON {_json_type(value)}"
        )

    def mapping(self, value: Any, key: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"key {key!r} must be an object, not a JSON {_json_type(value)}")
        return value

    def text(self, value: Any, key: str) -> str:
        """A string value, with the spec's variables substituted where fila can mean the same."""
        if not isinstance(value, str):
            raise self.fail(
                f"key {escape_name(key)[:200]!r} must be a string, not a JSON {_json_type(value)}"
            )
        return _VARIABLE.sub(lambda m: self.variable(m, key), value)

    def variable(self, m: re.Match[str], key: str) -> str:
        name = m.group(1).split(":")[0]
        where = f"{m.group(0)[:100]!r} in key {escape_name(key)[:200]!r}"
        if name == "containerWorkspaceFolder":
            return PROJECT_PATH
        if name == "containerWorkspaceFolderBasename":
            return PurePosixPath(PROJECT_PATH).name
        if name in ("localEnv", "env"):
            raise self.fail(
                f"{where} is refused: it reads the host's environment, which fila never passes on",
                hint="write the value itself, or set a variable in containerEnv",
            )
        if name in ("localWorkspaceFolder", "localWorkspaceFolderBasename"):
            raise self.fail(
                f"{where} is refused: it is a path on the host, which no container of fila sees",
                hint=f"the project is at {PROJECT_PATH} (${{containerWorkspaceFolder}})",
            )
        if name == "containerEnv":
            raise self.fail(
                f"{where} is refused: fila does not substitute the container's own variables",
                hint="in a shell command write $NAME: the shell expands it",
            )
        if name == "devcontainerId":
            raise self.fail(f"{where} is refused: it names one host's container, not the environment")
        return m.group(0)  # not a variable of the spec: left as it is, as the CLI does


def _json_type(value: Any) -> str:
    for kind, name in (
        (bool, "boolean"),
        (str, "string"),
        (int, "number"),
        (float, "number"),
        (list, "array"),
        (dict, "object"),
    ):
        if isinstance(value, kind):
            return name
    return "null"
