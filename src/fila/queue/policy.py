"""Policies: loading, validating, and a task's narrowing of them (never widening)."""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..assets import shipped_dir
from ..core import untrusted
from ..core.errors import InvalidPolicy, InvalidTaskFile, UnknownPolicy
from ..core.layout import Root
from ..core.models import Limits, Policy, PolicyRef, Task, parse_size, published_schema, valid_id


@functools.cache
def _validator(kind: str) -> Any:
    """The JSON Schema validator of a format, built once: every task and policy a worker reads is
    validated. The schema is the models' (`published_schema`: stored, not generated per process)."""
    import jsonschema  # lazy: start-up time of every other command

    return jsonschema.Draft202012Validator(published_schema(kind))


def validate_document(kind: str, data: Any, *, path: Path | str | None = None) -> None:
    """Validate against the published JSON Schema so the error names the field.

    A document the model accepts in strict mode (no coercion: a string is never read as a number,
    nor a bool as an integer) is one the schema accepts too, the schema being generated from the
    same models whose patterns refuse at least what Python's do (tests/test_cli_startup.py tries
    both on hostile variants): it is accepted without jsonschema, whose import alone is 40-70 ms
    of every submit and every worker's first claim. Anything else goes through the schema first,
    then the model, as before: the same errors, the same documents accepted."""
    if _strictly_valid(kind, data):
        return
    errors = sorted(_validator(kind).iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        from jsonschema.exceptions import best_match

        # best_match descends into `anyOf` (an optional field): "limits.cpus: 0.001 is less than
        # the minimum of 0.01" rather than "limits: not valid under any of the given schemas".
        err = best_match(errors)
        field = ".".join(str(p) for p in err.absolute_path) or None
        msg = err.message + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
        if kind == "task":
            raise InvalidTaskFile(msg, field=field, path=path)
        raise InvalidPolicy(f"{kind} field {field!r}: {msg}" if field else msg, path=path)
    _validate_model(kind, data, path=path)


def _strictly_valid(kind: str, data: Any) -> bool:
    import pydantic

    from ..core.models import Policy, Task

    models: dict[str, type[pydantic.BaseModel]] = {"task": Task, "policy": Policy}
    if kind not in models:
        return False
    try:
        models[kind].model_validate(data, strict=True)
    except pydantic.ValidationError:
        return False
    return True


def _validate_model(kind: str, data: Any, *, path: Path | str | None) -> None:
    """What a JSON Schema cannot say (a size's bytes within its floor and ceiling, a default within
    its cap, an id with a trailing newline that Python's `$` lets through) the models check:
    refused here as input, naming the field, never escaping as a pydantic error."""
    import pydantic

    from ..core.models import Policy, Record, Task

    models: dict[str, type[pydantic.BaseModel]] = {"task": Task, "policy": Policy, "record": Record}
    try:
        models[kind].model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        msg = str(err["msg"]).removeprefix("Value error, ")
        if kind == "task":
            raise InvalidTaskFile(msg, field=field, path=path) from None
        raise InvalidPolicy(f"{kind} field {field!r}: {msg}" if field else msg, path=path) from None


def load_json(path: Path, kind: str) -> Any:
    """An untrusted task or policy file, through the one safe reader (core/untrusted.py)."""
    return _read(path, kind)[0]


def _read(path: Path, kind: str) -> tuple[Any, bytes]:
    cls = InvalidTaskFile if kind == "task" else InvalidPolicy
    cap = untrusted.MAX_TASK_BYTES if kind == "task" else untrusted.MAX_POLICY_BYTES
    return untrusted.read_json(path, kind=kind, cap=cap, error=cls)


def policy_names(root: Root) -> list[str]:
    names = {p.stem for p in shipped_dir("policies").glob("*.json")}
    if root.policies_dir.is_dir():
        names |= {p.stem for p in root.policies_dir.glob("*.json")}
    return sorted(names)


def policy_path(root: Root, name: str) -> Path:
    if valid_id(name):
        for d in (root.policies_dir, shipped_dir("policies")):
            p = d / f"{name}.json"
            if os.path.lexists(p):  # whatever it is: the reader says why it is not a policy
                return p
    raise UnknownPolicy(
        f"unknown policy {name!r}",
        hint=f"valid policies: {', '.join(policy_names(root))} (files in {root.policies_dir})",
    )


def load_policy(root: Root, name: str) -> tuple[Policy, PolicyRef]:
    path = policy_path(root, name)
    # The hash is of the bytes that were parsed: a second read could see another file.
    data, raw = _read(path, "policy")
    validate_document("policy", data, path=path)
    policy = Policy.model_validate(data)
    if policy.default_timeout_ms > policy.max_timeout_ms:
        raise InvalidPolicy("default_timeout_ms is above max_timeout_ms", path=path)
    untrusted.check_names(
        [
            *(("deny", d) for d in policy.deny),
            *(("images", i) for i in policy.images),
            ("runtime", policy.runtime),
        ],
        error=InvalidPolicy,
        path=path,
    )
    _deny_spec(tuple(policy.deny))  # a rule pathspec cannot read is refused now, not mid-copy
    from ..egress import (
        config as egress,  # network allowlist: routes, names, credentials (errors name the field)
    )

    egress.validate(policy, path=path)
    sha = hashlib.sha256(raw).hexdigest()
    return policy, PolicyRef(name=name, sha256=sha)


def install_shipped(root: Root) -> list[str]:
    """Copy shipped policies into ROOT/policies (never over a file that is there)."""
    root.policies_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for src in sorted(shipped_dir("policies").glob("*.json")):
        dst = root.policies_dir / src.name
        if not dst.exists():
            shutil.copyfile(src, dst)
            copied.append(src.stem)
    return copied


@dataclass(frozen=True)
class Effective:
    """What a run gets: the policy narrowed by the task."""

    timeout_ms: int
    limits: Limits


def narrow(policy: Policy, task: Task, *, name: str = "") -> Effective:
    """Apply a task's narrowing. Asking for more than the policy is refused, never clipped."""
    where = f"policy {name!r}" if name else "the policy"
    timeout = task.timeout if task.timeout is not None else policy.default_timeout_ms
    if timeout > policy.max_timeout_ms:
        raise InvalidPolicy(
            f"timeout {timeout} ms is above the cap of {where} ({policy.max_timeout_ms} ms)",
            hint="ask for a shorter timeout, or use a policy with a higher max_timeout_ms",
        )
    lim = task.limits or Limits()
    # Validated again: a Task built in code (model_construct, attribute assignment) skips the
    # model's floors, and below a floor Docker reads "no limit" (memory "0" ran unlimited).
    limits = lim.model_dump(exclude_none=True)
    _validate_model("task", {"engine": "-", "targets": ["-"], "limits": limits}, path=None)
    if lim.memory is not None and parse_size(lim.memory) > parse_size(policy.memory):
        raise InvalidPolicy(f"limits.memory {lim.memory} is above {where}'s memory {policy.memory}")
    if lim.cpus is not None and lim.cpus > policy.cpus:
        raise InvalidPolicy(f"limits.cpus {lim.cpus} is above {where}'s cpus {policy.cpus}")
    if lim.pids is not None and lim.pids > policy.pids:
        raise InvalidPolicy(f"limits.pids {lim.pids} is above {where}'s pids {policy.pids}")
    return Effective(timeout_ms=timeout, limits=lim)


def image_allowed(policy: Policy, image: str, tags: list[str] | tuple[str, ...] = ()) -> bool:
    """An image the policy's patterns match: by its reference (`name@sha256:...` by its name, the
    digest pinning the content), or by one of `tags`, the local tags of an image pinned by id."""
    name = image.split("@", 1)[0] if "@" in image else image
    return any(fnmatch.fnmatchcase(c, pat) for pat in policy.images for c in (name, *tags))


_ANY_DEPTH = "^(?:.+/)?"  # how pathspec starts the regex of a rule without an inner '/'


@functools.lru_cache(maxsize=32)
def _deny_spec(deny: tuple[str, ...]) -> tuple[Any, re.Pattern[str] | None]:
    """The rules compiled once per rule set: pathspec's gitignore matcher, and one regex, the
    union of the rules that deny, which answers "no rule matches" (nearly every path) in one match.
    pathspec anchors and ends its regexes so that a rule matching a directory also matches every
    path below it: the union therefore also catches a path whose ancestor is denied."""
    import pathspec  # lazy: start-up time of the commands that never copy or diff

    try:
        spec = pathspec.GitIgnoreSpec.from_lines(deny)
    except (ValueError, TypeError, re.error) as e:
        # re.error: a range like [z-a], which git matches against nothing; pathspec cannot
        # compile it. Refused by its index, so the operator knows which rule to fix.
        bad = next((i for i, rule in enumerate(deny) if not _compiles(rule)), None)
        where = f"'deny.{bad}' ({deny[bad]!r})" if bad is not None else "'deny'"
        raise InvalidPolicy(
            f"policy field {where}: not a gitignore pattern fila can read: {e}",
            hint="deny rules use .gitignore syntax (see `git help gitignore`); a character "
            "range runs from low to high ([a-z])",
        ) from None
    # The group that marks a directory match is named in every rule's regex; the union needs none.
    rx = [p.regex.pattern.replace("(?P<ps_d>", "(?:") for p in spec.patterns if p.include]
    # Rules that match at any depth share one prefix: factored out, the regex tries each directory
    # boundary once instead of once per rule (3x faster on 10,000 paths).
    floating = [r[len(_ANY_DEPTH) :] for r in rx if r.startswith(_ANY_DEPTH)]
    alts = [f"(?:{r})" for r in rx if not r.startswith(_ANY_DEPTH)]
    if floating:
        alts.append(_ANY_DEPTH + "(?:" + "|".join(f"(?:{r})" for r in floating) + ")")
    try:
        return spec, (re.compile("|".join(alts)) if alts else None)
    except re.error as e:  # each rule compiled alone: their union should too; never a traceback
        raise InvalidPolicy(f"policy field 'deny': the rules do not combine: {e}") from None


def _compiles(rule: str) -> bool:
    import pathspec

    try:
        pathspec.GitIgnoreSpec.from_lines([rule])
    except (ValueError, TypeError, re.error):
        return False
    return True


def denied_by(rel: str, is_dir: bool, deny: list[str]) -> str | None:
    """The deny rule that excludes a project path, or None. Rules have .gitignore semantics
    (pathspec): 'x/' matches a directory at any depth, a rule without an inner '/' matches a name
    at any depth, '/x' and 'a/x' match from the project root, '**' spans directories, the last
    matching rule wins and '!rule' re-allows, except below an excluded directory (git never
    looks inside one): so every ancestor directory is judged before the path itself."""
    spec, union = _deny_spec(tuple(deny))
    full = rel + "/" if is_dir else rel
    # Runs for every path of every tree fila copies or diffs: usually no rule matches at all.
    if union is None or union.match(full) is None:
        return None
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        path = full if i == len(parts) else "/".join(parts[:i]) + "/"
        if union.match(path) is not None:
            res = spec.check_file(path)
            if res.include:
                return deny[res.index]
    return None
