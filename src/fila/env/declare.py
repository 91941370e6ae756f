"""Where a project declares its environment, and what of the project the declaration may name
(docs/environments.md, "Declaring").

A project declares it in `.devcontainer/devcontainer.json`, `.devcontainer.json` (the Dev
Containers spec's places, read by env.devcontainer) or `fila-environment.json` (fila's own form:
strict JSON of env.spec.EnvSpec); the first found wins, or the task names one. Every path the
declaration names is then checked against the project without following a link: the Dockerfile,
the build context, each input and each provided directory must be inside the project and reached
through no symlink, because the setup and the build see those files and the environment's key is
made of them. A lockfile that is a link out of the project would hand a host file to the setup.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ValidationError

from ..core import fsutil
from ..core.errors import InvalidEnvironment, InvalidPolicy
from ..core.text import escape_name
from ..core.untrusted import check_names, entry_kind, image_reference, parse_json, read_capped
from ..queue.policy import denied_by
from ..workspace.safedir import SafeDir, ThroughLink
from . import devcontainer
from .spec import Declared, EnvSpec, Step

FILA_FORM = "fila-environment.json"
# Where a project's declaration is looked for, in this order (the first found wins).
PLACES = (".devcontainer/devcontainer.json", ".devcontainer.json", FILA_FORM)
NO_ENVIRONMENT = "none"  # an explicit choice of no environment

MAX_INPUTS = 256  # lockfiles and manifests: a few per ecosystem
MAX_PROVIDED = 16  # each is a volume mounted into every job
MAX_PARALLEL = 16  # commands of one step run at once
MAX_WARNINGS = 50  # a declaration of a million unknown keys is not a million-line record
# A provided path becomes a deny rule (.gitignore syntax): a character that means a pattern there
# would hide more of the project than the path.
GLOB_CHARS = frozenset("[]*?!\\")
# What a package manager makes in the project tree: a project may hold one of these already
# (a developer's own `npm install`), and the environment's replaces it in every job. Any other
# provided directory must not hide files of the project (a `tests/` the setup made would replace
# the project's own, and pass its check).
MADE_BY_TOOLS = frozenset(
    {"node_modules", ".venv", "venv", ".tox", ".nox", "vendor", "target", "__pycache__", ".pnpm-store",
     ".yarn", "bower_components", "site-packages", ".bundle", "_build", "deps"}
)  # fmt: skip
MAX_INPUT_BYTES = 16 << 20  # a large package-lock.json is a few MiB

# The files a package manager reads to install a project's dependencies: the inputs taken when a
# declaration names none, at the project's top level and in the build context.
DEPENDENCY_FILES = (
    "requirements.txt",
    "pyproject.toml",
    "setup.py",
    "setup.cfg",
    "poetry.lock",
    "uv.lock",
    "Pipfile",
    "Pipfile.lock",
    "package.json",
    "package-lock.json",
    "npm-shrinkwrap.json",
    "yarn.lock",
    "pnpm-lock.yaml",
    ".nvmrc",
    ".python-version",
    "go.mod",
    "go.sum",
    "Cargo.toml",
    "Cargo.lock",
    "Gemfile",
    "Gemfile.lock",
)


def find(project: Path, explicit: str | None = None) -> Declared | None:
    """The environment `project` declares, checked against it; None when it declares none.
    `explicit`: a declaration's path relative to the project (read in the devcontainer form when
    its name ends in devcontainer.json, else in fila's), or "none" for no environment.
    Raises InvalidEnvironment naming the file, the key or the path and why."""
    if explicit == NO_ENVIRONMENT:
        return None
    if explicit is not None:
        check_names([("environment", explicit)], error=InvalidEnvironment, path=project)
        rel = _relative(explicit, "the environment's declaration", project)
    else:
        found = [p for p in PLACES if os.path.lexists(project / p)]
        if not found:
            return None
        rel = found[0]
    with SafeDir(project) as tree:
        _kind(
            _entry(tree, rel, "the environment's declaration"),
            rel,
            "the environment's declaration",
            "file",
            tree,
        )
    declared = (
        devcontainer.read(project, rel) if rel.endswith("devcontainer.json") else read_fila(project, rel)
    )
    return checked(project, declared)


def read_fila(project: Path, rel: str) -> Declared:
    """fila's own form: `rel` (relative to the project) is strict JSON of EnvSpec."""
    path = project / rel
    raw = read_capped(path, cap=devcontainer.MAX_DECLARATION_BYTES, kind=FILA_FORM, error=InvalidEnvironment)
    data = parse_json(raw, kind=FILA_FORM, error=InvalidEnvironment, path=path)
    if not isinstance(data, dict):
        raise InvalidEnvironment(
            f"{FILA_FORM} is not a JSON object", path=path, hint='write {"image": "..."}'
        )
    try:
        spec = EnvSpec.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the document"
        raise InvalidEnvironment(f"field {escape_name(where)[:200]!r}: {first['msg']}", path=path) from None
    return Declared(spec=spec, source=rel, form="fila")


def checked(project: Path, declared: Declared) -> Declared:
    """`declared` with its paths normalised and checked against `project`, and the defaults taken
    (inputs, provided), each default named in a warning."""
    spec, where = declared.spec, project / declared.source
    warnings = list(declared.warnings)
    if (spec.image is None) == (spec.build is None):
        raise InvalidEnvironment(
            "an environment names exactly one of `image` and `build`"
            + (", not both" if spec.image is not None else ""),
            path=where,
        )
    if spec.image is not None and not image_reference(spec.image):
        raise InvalidEnvironment(
            f"image {escape_name(spec.image)[:200]!r} is not an image reference", path=where
        )
    _check_steps(spec.setup, "setup", where)
    paths = [("inputs", p) for p in spec.inputs] + [("provided", p) for p in spec.provided]
    if spec.build is not None:
        paths += [("build.dockerfile", spec.build.dockerfile), ("build.context", spec.build.context)]
    check_names(paths, error=InvalidEnvironment, path=where)
    if len(spec.inputs) > MAX_INPUTS:
        raise InvalidEnvironment(f"{len(spec.inputs)} inputs, above the limit of {MAX_INPUTS}", path=where)
    if len(spec.provided) > MAX_PROVIDED:
        raise InvalidEnvironment(
            f"{len(spec.provided)} provided directories, above the limit of {MAX_PROVIDED}", path=where
        )
    update: dict[str, Any] = {}
    with SafeDir(project) as tree:
        if spec.build is not None:
            dockerfile = _relative(spec.build.dockerfile, "the Dockerfile", where)
            context = _relative(spec.build.context, "the build context", where)
            _kind(_entry(tree, dockerfile, "the Dockerfile"), dockerfile, "the Dockerfile", "file", tree)
            _kind(_entry(tree, context, "the build context"), context, "the build context", "dir", tree)
            update["build"] = spec.build.model_copy(update={"dockerfile": dockerfile, "context": context})
        inputs = _unique(_relative(p, "input", where) for p in spec.inputs)
        if not inputs and spec.setup:
            folders = ["."] + ([context] if spec.build is not None and context != "." else [])
            candidates = [
                name if folder == "." else f"{folder}/{name}"
                for folder in folders
                for name in DEPENDENCY_FILES
            ]
            inputs = [rel for rel in candidates if _entry(tree, rel, "input", missing_ok=True)]
            if inputs:
                warnings.append(
                    "no inputs declared: the setup is given the dependency files found, "
                    + ", ".join(inputs)
                    + " (declare `inputs` to choose)"
                )
        for rel in inputs:
            st = _kind(_entry(tree, rel, "input"), rel, "input", "file", tree)
            if st.st_size > MAX_INPUT_BYTES:
                raise InvalidEnvironment(
                    f"input {escape_name(rel)!r} is {st.st_size} bytes, above the limit of {MAX_INPUT_BYTES}",
                    path=tree.root / escape_name(rel),
                )
        provided = _unique(_provided(tree, p, where) for p in spec.provided)
        if not provided:
            provided = _unique(
                str(PurePosixPath(rel).parent / "node_modules")
                for rel in inputs
                if PurePosixPath(rel).name == "package.json"
            )
            if provided:
                warnings.append(
                    "no provided directories declared: "
                    + ", ".join(provided)
                    + " (beside package.json) is taken as made by the setup (declare `provided` to choose)"
                )
            provided = [_provided(tree, p, where) for p in provided]
    try:
        denied_by(".", True, deny_rules(provided))
    except InvalidPolicy as e:
        raise InvalidEnvironment(
            f"the provided directories do not make deny rules: {e.message}", path=where
        ) from None
    if len(warnings) > MAX_WARNINGS:
        warnings = [*warnings[:MAX_WARNINGS], f"and {len(warnings) - MAX_WARNINGS} more warnings, not shown"]
    update.update(inputs=inputs, provided=provided)
    return declared.model_copy(update={"spec": spec.model_copy(update=update), "warnings": warnings})


def deny_rules(provided: list[str]) -> list[str]:
    """The deny rules of the provided directories (anchored at the project's root): never copied
    into a job, never in its diff."""
    return [f"/{p.strip('/')}/" for p in provided]


def _check_steps(steps: list[Step], key: str, where: Path) -> None:
    """Each step is one of a shell command, an argv, or commands run at once (one level deep, as
    the spec's object form is)."""
    for i, step in enumerate(steps):
        forms = [f for f in ("shell", "argv", "parallel") if getattr(step, f) is not None]
        if len(forms) != 1:
            raise InvalidEnvironment(
                f"{key}[{i}] ({escape_name(step.name)[:100]!r}) has "
                + (" and ".join(f"`{f}`" for f in forms) if forms else "no command"),
                hint="give each step exactly one of `shell`, `argv` and `parallel`",
                path=where,
            )
        if step.parallel is not None:
            if len(step.parallel) > MAX_PARALLEL:
                raise InvalidEnvironment(
                    f"{key}[{i}].parallel holds {len(step.parallel)} commands, "
                    f"above the limit of {MAX_PARALLEL}",
                    path=where,
                )
            if any(sub.parallel is not None for sub in step.parallel):
                raise InvalidEnvironment(
                    f"{key}[{i}].parallel holds a `parallel` step: commands run at once are one level deep",
                    path=where,
                )
            _check_steps(step.parallel, f"{key}[{i}].parallel", where)


def _relative(value: str, what: str, where: Path) -> str:
    """`value` as a normalised path relative to the project ("." for the project itself);
    an absolute path or one with `..` is refused."""
    pure = PurePosixPath(value)
    if pure.is_absolute() or ".." in pure.parts or not value:
        raise InvalidEnvironment(
            f"{what} {escape_name(value)[:200]!r} is outside the project",
            hint="name it relative to the project, without '..'",
            path=where,
        )
    return pure.as_posix()


def _provided(tree: SafeDir, value: str, where: Path) -> str:
    """A directory the setup makes in the project tree: inside it, not the project itself; what
    of it exists already is a directory reached through no symlink."""
    rel = _relative(value, "provided directory", where)
    shown = escape_name(rel)[:200]
    if rel == ".":
        raise InvalidEnvironment(
            "provided directory '.' is the whole project",
            hint="name the directories the setup makes",
            path=where,
        )
    if GLOB_CHARS.intersection(rel) or rel.startswith("#"):
        raise InvalidEnvironment(
            f"provided directory {shown!r} holds a pattern character ([ ] * ? ! \\ or a leading #)",
            hint="name each directory by its plain path",
            path=where,
        )
    st = _entry(tree, rel, "provided directory", missing_ok=True)
    if st is not None:
        _kind(st, rel, "provided directory", "dir", tree)
        if PurePosixPath(rel).name not in MADE_BY_TOOLS and _holds_files(tree, rel):
            raise InvalidEnvironment(
                f"provided directory {shown!r} holds files of the project: the setup's would hide them "
                "in every job (and in its check)",
                hint="provide only directories the setup makes (node_modules, .venv), not the project's own",
                path=where,
            )
    return rel


def _holds_files(tree: SafeDir, rel: str) -> bool:
    with tree.parent(rel) as (dfd, name):
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
        try:
            return bool(os.listdir(fd))
        finally:
            os.close(fd)


def _entry(tree: SafeDir, rel: str, what: str, *, missing_ok: bool = False) -> os.stat_result | None:
    """lstat of `rel` below the project, reached one directory at a time without following a
    link; a symlink there or on the way is refused. None when missing (with missing_ok)."""
    shown = escape_name(rel)[:200]
    if rel == ".":
        return os.fstat(tree.fd)
    try:
        with tree.parent(rel) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise InvalidEnvironment(f"{what} {shown!r} does not exist in the project", path=tree.root) from None
    except ThroughLink as e:
        raise InvalidEnvironment(
            f"{what} {shown!r} is refused: on the way, {e.message}; fila follows no link in the project",
            hint="name the real path inside the project",
            path=tree.root,
        ) from None
    except OSError as e:  # a name too long, a directory fila may not read
        if fsutil.host_fault(e):  # the host's (no descriptors, an I/O error): not the project's
            raise
        raise InvalidEnvironment(f"cannot look at {what} {shown!r}: {e.strerror}", path=tree.root) from None
    if stat.S_ISLNK(st.st_mode):
        raise InvalidEnvironment(
            f"{what} {shown!r} is a symlink: fila follows no link in the project (a link may lead out of it)",
            hint="make it a regular file or directory of the project",
            path=tree.root,
        )
    return st


def _kind(st: os.stat_result | None, rel: str, what: str, want: str, tree: SafeDir) -> os.stat_result:
    assert st is not None
    ok = stat.S_ISREG(st.st_mode) if want == "file" else stat.S_ISDIR(st.st_mode)
    if not ok:
        found = "a regular file" if stat.S_ISREG(st.st_mode) else entry_kind(st.st_mode)
        wanted = "a regular file" if want == "file" else "a directory"
        raise InvalidEnvironment(
            f"{what} {escape_name(rel)[:200]!r} is {found}, not {wanted}",
            path=tree.root,
        )
    return st


def _unique(rels: Any) -> list[str]:
    return list(dict.fromkeys(rels))
