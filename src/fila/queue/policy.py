"""Policies: loading, validating, and a task's narrowing of them (never widening)."""

from __future__ import annotations

import contextlib
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
from ..core.models import Limits, Policy, PolicyRef, Record, Task, parse_size, published_schema, valid_id


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


# -- learn, then lock (README, "Learn, then lock") ------------------------------------------------


@dataclass(frozen=True)
class Suggestion:
    """`fila policy suggest`: the policy the runs' gateways would have let do what they did."""

    name: str  # the policy the runs ran under
    path: Path
    old_text: str
    new_text: str  # the policy document with the smallest allowlist and learning off
    allow: list[dict[str, Any]]
    learned: list[str]  # host:port the runs reached only because the policy was learning
    unused: list[str]  # entries (and routes) of the current policy no run used
    notes: list[str]  # what makes the suggestion less than certain

    def diff(self, new_name: str | None = None) -> str:
        from ..egress.suggest import unified

        return unified(self.old_text, self.new_text, f"policies/{self.name}.json",
                       f"policies/{new_name or self.name}.json")  # fmt: skip


def suggest(root: Root, records: list[Record], *, wildcards: bool = False, setup: bool = False) -> Suggestion:
    """The smallest allowlist for `records` (runs under one policy), as that policy's new text.
    Refused when the runs ran under different policies or have no egress record. `setup`: what
    their project environments' setups reached, as the policy's `environment.allow`
    (docs/environments.md)."""
    from ..egress import config as egress
    from ..egress import suggest as sg
    from ..egress.policy_text import locked_text

    names = sorted({r.policy.name for r in records if r.policy})
    if len(names) != 1:
        raise InvalidPolicy(
            f"the runs ran under {len(names)} policies ({', '.join(names) or 'none recorded'}); "
            "suggest reads runs of one policy",
            hint="give the ids of runs under one policy",
        )
    name = names[0]
    of = _setup_egress_of if setup else _egress_of
    section = "environment" if setup else "egress"
    egress_recs = [e for r in records for e in of(r)]
    missing = [r.id for r in records if not of(r)]
    if missing and setup:
        raise InvalidPolicy(
            f"no setup gateway record for {', '.join(missing)}: only a task that built its project "
            "environment through the gateway has one",
            hint='set the policy\'s "environment": {"learn": true, "max_requests": N} and build it again '
            "(`fila env build --force`, or a task after a changed lockfile)",
        )
    if missing:
        raise InvalidPolicy(
            f"no gateway record for {', '.join(missing)}: only runs under network allowlist that "
            "reached the gateway can be read",
            hint='run the task under a policy with "network": "allowlist" (and "learn": true to learn)',
        )
    path = policy_path(root, name)
    doc, raw = _read(path, "policy")
    used = sg.used_hosts(egress_recs)
    allow = sg.entries_for(used, wildcards=wildcards, listed=sg.listed_names(doc))
    new_doc = sg.locked_document(doc, allow, section)
    notes = sg.method_notes(used)
    changed = [r.id for r in records if r.policy and r.policy.sha256 != hashlib.sha256(raw).hexdigest()]
    if changed:
        notes.append(
            f"policies/{name}.json changed since run {', '.join(changed)}: the diff is against today's"
        )
    if dropped := sum(e.dropped for e in egress_recs):
        notes.append(f"{dropped} gateway log lines were not kept in the records: hosts may be missing")
    if not any(e.learning for e in egress_recs):
        what = "these setups" if setup else "these runs"
        notes.append(f"policy {name!r} was not learning in {what}: only listed hosts can appear")
    # What the engine reached is the engine's doing: the proposal is checked as any policy file is.
    validate_document("policy", new_doc, path=f"the suggestion for {path}")
    egress.validate(Policy.model_validate(new_doc), path=f"the suggestion for {path}")
    learned = [f"{h}:{p}" for (h, p), u in sorted(used.items()) if u.learned]
    old_text = raw.decode("utf-8", errors="replace")
    new_text = locked_text(old_text, new_doc, allow, section)
    return Suggestion(
        name,
        path,
        old_text,
        new_text,
        allow,
        learned,
        sg.unused_entries(doc, used, egress_recs, section),
        notes,
    )


def _setup_egress_of(rec: Record) -> list[Any]:
    env = rec.environment
    return [env.egress] if env is not None and env.egress is not None else []


def _egress_of(rec: Record) -> list[Any]:
    found = [a.egress for a in rec.attempts if a.egress is not None]
    return found or ([rec.egress] if rec.egress is not None else [])


def write_suggested(root: Root, name: str, s: Suggestion, *, force: bool = False) -> Path:
    """policies/<name>.json holding the suggestion; never over an existing file, nor under a
    shipped policy's name (it would shadow that policy), without `force`. The temporary file is
    created anew (O_EXCL, O_NOFOLLOW): a link planted at its name is never written through."""
    from ..core.errors import Refused

    if not valid_id(name):
        raise InvalidPolicy(f"{name!r} is not a policy name", hint="letters, digits, . _ - (like a task id)")
    root.policies_dir.mkdir(parents=True, exist_ok=True)
    dst = root.policies_dir / f"{name}.json"
    if os.path.lexists(dst) and not force:
        raise Refused(f"policy {name!r} exists already", path=dst, hint="choose another name, or add --force")
    if os.path.lexists(shipped_dir("policies") / f"{name}.json") and not force:
        raise Refused(
            f"policy {name!r} is a shipped policy's name: {dst} would replace it for this root",
            path=dst,
            hint="choose another name, or add --force",
        )
    tmp = dst.with_name(f".{name}.json.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of an interrupted write (or a planted link): removed, not followed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(s.new_text)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return dst
