"""An environment's key (docs/environments.md, "The key"): the sha256 of everything its setup
depended on, so a task whose key exists pays no setup and a changed lockfile makes a new one.

What goes in: the base (the image's id, or the Dockerfile's bytes with its context's manifest,
build args and target), the variables, the setup commands, the declared inputs' bytes, the
provided paths, the setup's network policy (its routes' upstreams, headers and paths, never their
credentials) and fila's own setup format. What stays out: the rest of the project. The setup
sees only its inputs (`build.stage_inputs`), so it cannot depend on a file the key does not name.
"""

from __future__ import annotations

import errno
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import FilaError, InvalidInput
from ..core.models import SetupPolicy
from ..egress import config as egress
from ..workspace import fswalk
from ..workspace.safedir import SafeDir, ThroughLink
from .spec import PROJECT_PATH, EnvSpec

# Part of every key: a change of how fila runs a setup (the script, the image's layout) must not
# reuse an environment made the old way.
FORMAT = 3
MAX_INPUT_BYTES = 16 << 20
MAX_CONTEXT_FILES = 50_000
MAX_CONTEXT_BYTES = 2 << 30


@dataclass(frozen=True)
class Inputs:
    """The declared input files, read once: their bytes are both hashed and staged for the setup,
    so what the key names is exactly what the setup reads."""

    files: dict[str, bytes]

    def digests(self) -> dict[str, str]:
        return {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(self.files.items())}


def read_inputs(project: Path, spec: EnvSpec) -> Inputs:
    """The inputs' bytes, each a regular file inside the project reached without a link (a
    lockfile that is a link out of the project is refused), read through the project's directory
    descriptors (workspace/safedir.py): a name swapped for a link after declare checked it is
    refused too, never followed."""
    from pathlib import PurePosixPath

    files: dict[str, bytes] = {}
    hint = (
        f"inputs are regular files of the project, each at most {MAX_INPUT_BYTES >> 20} MiB, "
        "reached without a symlink"
    )
    with SafeDir(project) as tree:
        for rel in spec.inputs:
            pure = PurePosixPath(rel)
            if pure.is_absolute() or ".." in pure.parts or "\x00" in rel:
                raise InvalidInput(f"environment input {rel!r} is outside the project", path=project)
            try:
                files[rel] = tree.read(pure.as_posix(), max_bytes=MAX_INPUT_BYTES)
            except ThroughLink as e:
                raise InvalidInput(f"environment input {rel!r} passes through a symlink: {e.message}",
                                   path=project, hint=hint) from None  # fmt: skip
            except FileNotFoundError:
                raise InvalidInput(f"environment input {rel!r} does not exist", path=project) from None
            except OSError as e:
                why = "is a symlink" if e.errno == errno.ELOOP else f"cannot be read: {e.strerror}"
                raise InvalidInput(f"environment input {rel!r} {why}", path=project, hint=hint) from None
            except FilaError as e:
                raise InvalidInput(f"environment input {rel!r} cannot be read: {e.message}",
                                   path=project, hint=hint) from None  # fmt: skip
    return Inputs(files)


Skip = Callable[[str, bool], bool]


def context_entries(project: Path, spec: EnvSpec, skip: Skip) -> tuple[Path, list[fswalk.Entry]]:
    """The build context's directory and what of it the build is given: every entry but those
    `skip` (given the path relative to the project) leaves out, links never followed."""
    assert spec.build is not None
    context = _inside(project, spec.build.context, "build context")
    prefix = "" if spec.build.context == "." else spec.build.context + "/"
    entries = list(
        fswalk.walk(
            context,
            skip=lambda rel, is_dir: skip(prefix + rel, is_dir),
            max_files=MAX_CONTEXT_FILES,
            max_bytes=MAX_CONTEXT_BYTES,
        )
    )
    return context, entries


def context_digest(project: Path, spec: EnvSpec, skip: Skip) -> dict[str, str]:
    """The Dockerfile's sha256 and a manifest digest of its build context as the build is given it
    (context_entries: the files' and links' names, portable modes and contents; links as links,
    never followed; directories only as the paths they hold)."""
    assert spec.build is not None
    dockerfile = _inside(project, spec.build.dockerfile, "Dockerfile")
    context, entries = context_entries(project, spec, skip)
    h = hashlib.sha256()
    for entry in entries:
        if entry.kind not in ("file", "symlink"):
            continue  # directories are implied by what they hold; nothing else is built from
        h.update(f"{entry.rel}\0{entry.kind}\0{portable_mode(entry):o}\0".encode("utf-8", "surrogateescape"))
        if entry.kind == "file":
            h.update(hashlib.sha256(fswalk.read_file(context / entry.rel, max_bytes=entry.size)).digest())
        else:
            h.update(str(Path(context / entry.rel).readlink()).encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    df = fswalk.read_file(dockerfile, max_bytes=MAX_INPUT_BYTES)
    return {"dockerfile": hashlib.sha256(df).hexdigest(), "context": h.hexdigest()}


def portable_mode(entry: fswalk.Entry) -> int:
    """The mode the build is given for a context entry: what survives the trip to another host
    (a PostgreSQL runner lays files out 0755 or 0644 by the owner's execute bit), so the submitter's
    key and the runner's agree (docs/environments.md, "Many hosts")."""
    if entry.kind == "symlink":
        return 0o777
    return 0o755 if entry.mode & 0o100 else 0o644


def content(spec: EnvSpec, base: dict[str, Any], inputs: Inputs) -> str:
    """What the environment is made of, whoever sets it up: the base (`base`: the image's id, or
    the build's digests), the variables, the steps, the inputs' bytes and the provided paths. A
    submitter pins it in the task (Task.environment_digest); a runner that makes another refuses
    the task (docs/environments.md, "Many hosts")."""
    doc = {
        "format": FORMAT,
        "project_path": PROJECT_PATH,
        "base": base,
        "env": dict(sorted(spec.env.items())),
        "setup": [s.model_dump(exclude_none=True) for s in spec.setup],
        "inputs": inputs.digests(),
        "provided": sorted(spec.provided),
    }
    return _digest(doc)


def compute(digest: str, setup: SetupPolicy) -> str:
    """The key: the environment's content `digest` and the setup's network policy (the host that
    sets it up decides what its setup may reach: a different policy is a different environment)."""
    network = setup.model_dump(mode="json", include={"allow", "allow_private", "learn", "max_requests"})
    doc: dict[str, Any] = {"format": FORMAT, "content": digest, "network": network}
    if setup.routes:
        # What each route sends where, never its credential: a rotated token reuses the environment.
        doc["routes"] = {name: list(egress.route_shape(name, r)) for name, r in sorted(setup.routes.items())}
    return _digest(doc)


def _digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _inside(project: Path, rel: str, what: str) -> Path:
    """`project/rel`, refused when it leaves the project or passes through a symlink on the way
    (the last part included): a declaration cannot make fila read or send a host file."""
    from pathlib import PurePosixPath

    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\x00" in rel:
        raise InvalidInput(f"environment {what} {rel!r} is outside the project", path=project)
    cur = project
    for part in pure.parts:
        if part == ".":
            continue
        cur = cur / part
        if cur.is_symlink():
            raise InvalidInput(
                f"environment {what} {rel!r} passes through a symlink ({cur.relative_to(project)})",
                path=project,
                hint="name the file itself, inside the project",
            )
    if not cur.exists():
        raise InvalidInput(f"environment {what} {rel!r} does not exist", path=project)
    return cur
