"""An environment made or found by its key (docs/environments.md, "The setup").

`prepare` is what a task and `fila env build` call: it reads the declaration's inputs, resolves
the base (the image, or the project's Dockerfile, its RUN steps through a gateway of their own),
computes the key, and when no image carries it runs the setup: a container of the base, as root
with SETUP_CAPS only, a gateway of its own in front of the setup policy's hosts, only the
declared inputs copied in, the setup's commands run at the project's path, its result committed
as the environment's image, its provided paths copied once into volumes. Each engine the task
runs gets a layer on top (`engines.layer`). A failed setup raises EnvironmentFailed with its
log: no engine starts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import fsutil
from ..core.errors import FilaError, InvalidInput, InvalidPolicy, LimitExceeded
from ..core.layout import Root
from ..core.models import (
    Egress,
    EgressRecord,
    EnvironmentRecord,
    ImageRef,
    Policy,
    SetupPolicy,
    Tmpfs,
    now_iso,
    parse_size,
)
from ..core.mounts import Bind, ProvidedVolume
from ..egress import config as egress
from ..sandbox.base import JOB_LABEL, ROOT_LABEL, Backend, ImageInfo, RunSpec, SetupRun
from ..sandbox.base import LABEL as LABEL_FILA
from ..workspace import fswalk
from ..workspace.jobdir import excluded_prefixes, exclusion
from . import dockerfile, hold
from . import key as keys
from .spec import PROJECT_PATH, Declared, EnvSpec, Step

LABEL = "fila.env"
KEY_LABEL = "fila.env.key"
IMAGE_REPO = "fila/env"
VOLUMES_LABEL = "fila.env.volumes"
# What a setup container is labelled with that would make a container of the committed image look
# like a job of that root to fila's sweepers: emptied in the image (docs/environments.md).
CLEARED_LABELS = (LABEL_FILA, JOB_LABEL, ROOT_LABEL, "fila.role", "fila.worker")
SETUP_DIR = "/fila-setup"
# The gateway's variables the setup had: emptied in the image so no engine inherits a proxy (nor
# a setup route's URL: route_vars).
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy")
# Where the tools an engine and the check run keep their caches: /tmp, not work/, so a run of the
# project's tests leaves no __pycache__ or .pytest_cache in the diff (docs/environments.md,
# "Caches"). Set in the environment's image after its setup (the setup's own bytecode stays where
# it installed it); a variable the declaration sets is the declaration's.
CACHE_ENV = {
    "PYTHONPYCACHEPREFIX": "/tmp/.fila-cache/pycache",
    "PYTEST_ADDOPTS": "-o cache_dir=/tmp/.fila-cache/pytest",
    "MYPY_CACHE_DIR": "/tmp/.fila-cache/mypy",
    "RUFF_CACHE_DIR": "/tmp/.fila-cache/ruff",
}
HEARTBEAT_S = 2.0


class EnvironmentFailed(FilaError):
    """The setup (or the base's build) failed: the task ends `failed` with kind `environment`."""

    def __init__(self, message: str, *, record: EnvironmentRecord, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.record = record


@dataclass
class Prepared:
    """An environment ready for a task: its image, its provided volumes and what the record says."""

    declared: Declared
    key: str
    image: ImageRef
    record: EnvironmentRecord
    volumes: list[ProvidedVolume] = field(default_factory=list)


def envs_dir(root: Root) -> Path:
    """Per key: the setup's log and what it measured (`setup.json`), for later tasks' records."""
    return root.path / "sandbox" / "envs"


# A key as fila computes it (a sha256): anything else in a label is not fila's and names nothing.
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")


def valid_key(key: object) -> bool:
    return isinstance(key, str) and KEY_PATTERN.fullmatch(key) is not None


def tag_for(key: str) -> str:
    return f"{IMAGE_REPO}:{key[:32]}"


def partial_prefix(key: str) -> str:
    """A setup's committed image before its volumes are filled: `<prefix><build>` (one per build,
    so two setups of one key from different roots never share it)."""
    return f"{IMAGE_REPO}-partial:{key[:32]}-"


def volume_name(key: str, rel: str, build: str) -> str:
    """A provided path's volume: the key, the path's hash (64 bits) and the build that filled it
    (two setups of one key on a shared daemon never fill the same volume)."""
    return f"fila-env-{key[:24]}-{hashlib.sha256(rel.encode()).hexdigest()[:16]}-{build}"


def named_volumes(labels: dict[str, str], key: str) -> list[str]:
    """The volumes an environment's image names (VOLUMES_LABEL, in its provided paths' order);
    a name fila would not have made for `key` is dropped."""
    shape = re.compile(rf"fila-env-{key[:24]}-[0-9a-f]{{16}}-[0-9a-f]{{8}}")
    raw = labels.get(VOLUMES_LABEL) or ""
    return [n for n in raw.split(",") if shape.fullmatch(n)]


def cache_env(declared: dict[str, str]) -> dict[str, str]:
    """CACHE_ENV but what the declaration's variables decide (PYTHONDONTWRITEBYTECODE set: no
    bytecode is written at all)."""
    out = {k: v for k, v in CACHE_ENV.items() if k not in declared}
    if "PYTHONDONTWRITEBYTECODE" in declared:
        out.pop("PYTHONPYCACHEPREFIX", None)
    return out


def require_docker(backend: Backend) -> None:
    if backend.name != "docker" or not hasattr(backend, "fill_volume"):
        raise InvalidInput(
            f"project environments run on the Docker backend; this one is {backend.name}",
            hint='set the task\'s "environment": "none" to run on the engine\'s own image',
        )


def resolve_base(
    root: Root,
    project: Path,
    declared: Declared,
    policy: Policy,
    backend: Backend,
    progress: Callable[[str], None],
    base: dict[str, Any],
    *,
    job_id: str,
) -> tuple[str, EgressRecord | None]:
    """The base image's id, `base` being what the key took of it (base_of), and what the build's
    gateway saw when it was built now. An `image` is that image; a Dockerfile is built when its
    image is missing, its RUN steps reaching the setup's allowlist through a gateway of their own
    (docs/environments.md, "A project Dockerfile")."""
    spec = declared.spec
    if spec.image is not None:
        return base["image_id"], None
    assert spec.build is not None
    setup = setup_policy(policy, policy.environment)
    # A base built under one allowlist is not another's: the network is part of its tag.
    allow = setup.egress
    network = allow.model_dump(mode="json", include={"allow", "allow_private", "learn"}) if allow else None
    if allow is not None and allow.routes:  # what each route sends where, never its credential
        network["routes"] = {n: list(egress.route_shape(n, r)) for n, r in sorted(allow.routes.items())}
    ident = json.dumps({**base, "network": network}, sort_keys=True).encode()
    tag = f"{IMAGE_REPO}-base:{hashlib.sha256(ident).hexdigest()[:32]}"
    info = backend.image_info(tag)
    built = None
    if info is None:
        where = "through the setup's gateway" if setup.egress else "no network"
        progress(f"environment: building the base from {spec.build.dockerfile} ({where})")
        context, entries = keys.context_entries(project, spec, _context_skip(root, project, policy))
        with tempfile.TemporaryDirectory(prefix="context-", dir=envs_dir(root).parent) as tmp:
            archive = Path(tmp) / "context.tar"
            # The bytes the key and the policy check read, or none: what the daemon builds is
            # exactly what fila checked (docs/environments.md, "A project Dockerfile").
            text = fswalk.read_file(
                project / spec.build.dockerfile, max_bytes=dockerfile.MAX_DOCKERFILE_BYTES
            )
            if hashlib.sha256(text).hexdigest() != base["dockerfile"]:
                raise InvalidInput(
                    f"the environment's Dockerfile {spec.build.dockerfile} changed while it was read",
                    hint="run the task again once the project stops changing",
                )
            name = dockerfile.archive(context, entries, text, archive)
            built = _build_base(root, backend, spec, setup, policy.environment, archive, name, tag,
                                 progress, job_id=job_id)  # fmt: skip
        info = backend.image_info(tag)
        if info is None:
            raise InvalidInput(f"the environment's Dockerfile built no image {tag}")
        if info.size > policy.environment.max_image_bytes:
            backend.remove_image(tag)
            raise InvalidInput(
                f"the environment's Dockerfile {spec.build.dockerfile} made an image of {info.size} bytes, "
                f"over environment.max_image_bytes {policy.environment.max_image_bytes}",
                hint="make the image smaller, or raise the policy's environment.max_image_bytes",
            )
    return info.id, built


def base_of(
    root: Root, project: Path, declared: Declared, policy: Policy, backend: Backend
) -> dict[str, Any]:
    """What the key takes of the base, nothing built: an allowed, present image's id, or the
    Dockerfile's and its context's digests with the ids of the local images it names."""
    spec = declared.spec
    if spec.image is not None:
        info = dockerfile.local_image(
            policy, backend, spec.image, f"the environment's image, {declared.source}"
        )
        return {"image_id": info.id}
    assert spec.build is not None
    digests = keys.context_digest(project, spec, _context_skip(root, project, policy))
    text = fswalk.read_file(project / spec.build.dockerfile, max_bytes=dockerfile.MAX_DOCKERFILE_BYTES)
    images = {
        ref: dockerfile.local_image(policy, backend, ref, f"{spec.build.dockerfile} line {line}").id
        for line, ref in dockerfile.references(dockerfile.decode(text))
    }
    return {**digests, "images": images, "args": dict(sorted(spec.build.args.items())),
            "target": spec.build.target}  # fmt: skip


def digest_of(root: Root, project: Path, declared: Declared, policy: Policy, backend: Backend) -> str:
    """The environment's content digest on this host (key.content), nothing built or started:
    what a submitter pins in the task (docs/environments.md, "Many hosts")."""
    require_docker(backend)
    refuse_denied_inputs(root, project, declared.spec, policy)
    inputs = keys.read_inputs(project, declared.spec)
    return keys.content(declared.spec, base_of(root, project, declared, policy, backend), inputs)


def _context_skip(root: Root, project: Path, policy: Policy) -> keys.Skip:
    """What of a build context the build is not given: what no job is given (the policy's deny
    rules, .git/, fila's own directories)."""
    prefixes = excluded_prefixes(root, project, root.policies_dir)
    return lambda rel, is_dir: exclusion(rel, is_dir, policy, prefixes) is not None


def refuse_denied_inputs(root: Root, project: Path, spec: EnvSpec, policy: Policy) -> None:
    """An input the policy's deny rules keep from every job (.env, .npmrc, .git/...) is not handed
    to the setup either: refused, naming the rule."""
    prefixes = excluded_prefixes(root, project, root.policies_dir)
    for rel in spec.inputs:
        why = exclusion(rel, False, policy, prefixes)
        if why is not None:
            raise InvalidInput(
                f"environment input {rel!r} is kept from every job ({why}): not given to the setup either",
                hint="name inputs the task may see; a registry's credential goes in a setup route "
                '(docs/environments.md, "Secrets for the setup")',
            )


def _build_base(root: Root, backend: Backend, spec: EnvSpec, setup: Policy, limits: SetupPolicy,
                archive: Path, name: str, tag: str, progress: Callable[[str], None], *,
                job_id: str) -> EgressRecord | None:  # fmt: skip
    """The base built by the daemon's classic builder within the setup's memory (no swap beyond
    it), pids (all its RUN steps together, in a cgroup of the build's), max_image_bytes (each
    step measured while it runs) and timeout. Under a setup allowlist each RUN step joins the job
    network of a gateway of the build's own and is given its proxy as build args (Docker's
    predefined proxy args: never in the image's history), so what a step reaches is the
    allowlist's, refused and logged like the setup's; with no allowlist, no network. What the
    builder's API cannot set (a RUN step's capabilities) is Docker's default (docs/environments.md,
    "A project Dockerfile")."""
    with backend.build_limits(root.path, job_id, limits.pids, limits.max_image_bytes) as held:  # type: ignore[attr-defined]
        if held.refused is not None:
            progress(f"warning: the Dockerfile's RUN steps get no pids or size limit while they run: "
                     f"{held.refused} (docs/environments.md)")  # fmt: skip
        try:
            return _build_in(root, backend, spec, setup, limits, archive, name, tag, progress,
                             job_id=job_id, cgroup_parent=held.cgroup_parent)  # fmt: skip
        except InvalidInput as e:
            failed = e
    if held.exceeded is not None:  # the step was killed for it: that is why the build failed
        raise InvalidInput(
            f"the environment's Dockerfile {spec.build.dockerfile} did not build: {held.exceeded}",  # type: ignore[union-attr]
            hint="write less in the RUN steps, or raise the policy's environment.max_image_bytes",
        ) from failed
    raise failed


def _build_in(root: Root, backend: Backend, spec: EnvSpec, setup: Policy, limits: SetupPolicy,
              archive: Path, name: str, tag: str, progress: Callable[[str], None], *,
              job_id: str, cgroup_parent: str | None) -> EgressRecord | None:  # fmt: skip
    assert spec.build is not None
    memory = parse_size(limits.memory)
    build = functools.partial(
        backend.build_context,
        archive,
        tag,
        # The Dockerfile's own LABEL lines survive the build: a key there is not fila's.
        labels={LABEL: "base", KEY_LABEL: ""},
        # Never the builder's cache, in or out: a layer one project fetched (through a route's
        # token, or an allowlist) must not serve another project's identical RUN line.
        nocache=True,
        progress=lambda line: progress(f"environment: {line}"),
        dockerfile=name,
        target=spec.build.target,
        limits={"memory": memory, "memswap": memory, "cpushares": max(2, int(1024 * limits.cpus))},
        deadline_s=limits.timeout_ms / 1000,
        cgroup_parent=cgroup_parent,
    )
    refused = backend.build_network_refusal() if setup.egress is not None else None  # type: ignore[attr-defined]
    if refused is not None:
        progress(f"warning: the Dockerfile's RUN steps get no network: {refused} (docs/environments.md)")
    if setup.egress is None or refused is not None:
        try:
            build(buildargs=dict(spec.build.args), network="none")
        except FilaError as e:
            offline = refused or "the policy's environment.allow is empty"
            raise _not_built(e, spec, limits, None, offline) from e
        return None
    failed: FilaError | None = None
    # The gateway's state (its routes' secrets) in a hold: removed after the build, or by the
    # sweep once this process is gone (env/hold.py).
    with hold.hold(root) as held, backend.build_gateway(  # type: ignore[attr-defined]
        # The task's own id (or `fila env build`'s hold's): a sweep beside it sees it alive.
        job_id=job_id, policy=setup, state=held.dir / "gateway",
        labels={"fila.root": str(root.path), "fila.role": "env-build"},
    ) as gateway:  # fmt: skip
        try:
            build(buildargs={**gateway.env, **spec.build.args}, network=gateway.network)
        except FilaError as e:  # said once the gateway's record is read (below)
            failed = e
    for w in gateway.warnings:
        progress(f"warning: {w}")
    if failed is not None:
        raise _not_built(failed, spec, limits, gateway.egress, None) from failed
    return gateway.egress


def _not_built(e: FilaError, spec: EnvSpec, limits: SetupPolicy, egress: EgressRecord | None,
               offline: str | None) -> InvalidInput:  # fmt: skip
    """The build's failure `e` said as the environment's, with the hosts its gateway refused, or
    why it had no network (`offline`)."""
    assert spec.build is not None
    message = f"the environment's Dockerfile {spec.build.dockerfile} did not build: {e.message}"
    if isinstance(e, LimitExceeded):
        return InvalidInput(
            f"{message} (environment.timeout_ms {limits.timeout_ms})",
            hint="make the build faster, or raise the policy's environment.timeout_ms",
        )
    refused = sorted({f"{r.host}:{r.port}" for r in (egress.requests if egress else []) if not r.allowed})
    if offline is not None:
        message += f"; its RUN steps have no network ({offline})"
        hint = "list the hosts its RUN steps need in the policy's environment.allow (docs/environments.md)"
    elif refused:
        message += f"; its gateway refused {', '.join(refused[:10])} (not in environment.allow)"
        hint = "list the hosts its RUN steps need in the policy's environment.allow, or drop those steps"
    else:
        hint = "its RUN steps reach only environment.allow, through fila's gateway"
    return InvalidInput(message, hint=hint)


def probe(
    root: Root, project: Path, declared: Declared, policy: Policy, backend: Backend
) -> tuple[str, bool]:
    """The environment's key and whether its image is built, building nothing (`fila doctor`)."""
    key = keys.compute(digest_of(root, project, declared, policy, backend), policy.environment)
    info = backend.image_info(tag_for(key))
    return key, info is not None and info.labels.get(KEY_LABEL) == key


def prepare(
    root: Root,
    project: Path,
    declared: Declared,
    policy: Policy,
    backend: Backend,
    *,
    job_id: str,
    progress: Callable[[str], None] = lambda _m: None,
    force: bool = False,
    heartbeat: Callable[[], None] | None = None,
    expect_digest: str | None = None,
) -> Prepared:
    """The environment's image for `declared`, built unless its key exists (`force`: again).
    `expect_digest`: the content digest the task was submitted with; another one here is refused
    before anything is built (docs/environments.md, "Many hosts")."""
    require_docker(backend)
    spec = declared.spec
    refuse_denied_inputs(root, project, spec, policy)
    inputs = keys.read_inputs(project, spec)
    base = base_of(root, project, declared, policy, backend)
    digest = keys.content(spec, base, inputs)
    key = keys.compute(digest, policy.environment)
    if expect_digest is not None and digest != expect_digest:
        raise EnvironmentFailed(
            f"the task was submitted for an environment made of {expect_digest[:12]}; on this host "
            f"its declaration ({declared.source}) makes {digest[:12]}: the base image or what the "
            "declaration reads differs from the submitter's",
            record=EnvironmentRecord(
                key=key,
                digest=digest,
                source=declared.source,
                form=declared.form,
                name=spec.name,
                how="failed",
                pinned=expect_digest,
                warnings=list(declared.warnings),
            ),
            hint="give this host the submitter's base image (fila images build, docker load), "
            "or resubmit the task from this host",
        )
    base_id, built = resolve_base(root, project, declared, policy, backend, progress, base, job_id=job_id)
    tag = tag_for(key)
    state = state_dir(root, key)
    common = dict(
        key=key,
        source=declared.source,
        form=declared.form,
        name=spec.name,
        provided=list(spec.provided),
        warnings=list(declared.warnings),
        digest=digest,
        pinned=expect_digest,
        build_egress=built,
    )
    with _locked(state):
        info = None if force else backend.image_info(tag)
        volumes = _volumes_ready(backend, key, spec, info)
        if info is not None and volumes is not None:
            progress(f"environment {key[:12]}: cached ({tag})")
            meta = _read_meta(state)
            record = EnvironmentRecord(
                **common,
                image=ImageRef(tag=tag, id=info.id),
                how="cached",
                setup_s=meta.get("setup_s"),
                log_path=meta.get("log_path"),
            )
            return Prepared(declared, key, record.image, record, volumes)  # type: ignore[arg-type]
        return _build(root, project, declared, policy, backend, inputs, base_id, key, state, common,
                      job_id=job_id, progress=progress, heartbeat=heartbeat)  # fmt: skip


def _build(root: Root, project: Path, declared: Declared, policy: Policy, backend: Backend,
           inputs: keys.Inputs, base_id: str, key: str, state: Path, common: dict[str, Any], *,
           job_id: str, progress: Callable[[str], None],
           heartbeat: Callable[[], None] | None) -> Prepared:  # fmt: skip
    spec = declared.spec
    tag = tag_for(key)
    log = state / "setup.log"
    log_rel = str(log.relative_to(root.path))
    source = json.dumps(declared.source)
    setup = policy.environment
    try:
        secrets_ = setup_credentials(setup)
    except InvalidPolicy as e:
        # Before any container: a setup without its registry's token would fail half way.
        raise EnvironmentFailed(
            f"the environment's setup cannot start: {e.message}",
            record=EnvironmentRecord(**common, how="failed"),
            hint=f"{e.hint or 'give the route its credential'}; a setup route's credential is read "
            'only when the environment is built (docs/environments.md, "Secrets for the setup")',
        ) from e
    progress(f"environment {key[:12]}: setting up from {declared.source} ({len(spec.setup)} step(s))")
    t0 = time.monotonic()
    build_id = secrets.token_hex(4)
    partial = partial_prefix(key) + build_id
    volumes = _volumes(spec, [volume_name(key, rel, build_id) for rel in spec.provided])
    cleared = " ".join(f'"{name}"=""' for name in CLEARED_LABELS)
    with tempfile.TemporaryDirectory(prefix="setup-", dir=state) as tmp:
        work = stage_inputs(Path(tmp), spec, inputs, ca=_ca_bytes(setup.ca_file))
        run_spec = RunSpec(
            job_id=job_id,
            workspace=SetupWorkspace(Path(tmp), work),
            image=base_id,
            argv=["/bin/sh", f"{SETUP_DIR}/setup.sh"],
            env=dict(spec.env),
            policy=setup_policy(policy, setup),
            limits=None,
            timeout_ms=setup.timeout_ms,
            log_path=log,
            labels={"fila.root": str(root.path), "fila.role": "env-setup", KEY_LABEL: key},
            # The routes' credentials are the setup's gateway's only; an echo in the log is replaced.
            redact=secrets_,
            egress_dir=state / "egress",
            setup=SetupRun(
                # Tagged as the environment only once its volumes are filled (below): a setup that
                # dies half way is never found by its key.
                commit_tag=partial,
                changes=tuple(
                    # fila sets every run's entrypoint and command; the setup's are not kept
                    # (an empty ENTRYPOINT does not clear it in a commit: env runs the command).
                    ['ENTRYPOINT ["/usr/bin/env"]', 'CMD ["sh"]']
                    + [f"ENV {v}=" for v in (*PROXY_VARS, *route_vars(setup))]
                    + [f"ENV {k}={json.dumps(v)}" for k, v in cache_env(spec.env).items()]
                    + [
                        f'LABEL "{LABEL}"="1" "{KEY_LABEL}"="{key}" "fila.env.source"={source} '
                        f'"{VOLUMES_LABEL}"="{",".join(v.name for v in volumes)}" {cleared}'
                    ]
                ),
                max_bytes=setup.max_image_bytes,
            ),
        )
        fsutil.remove_tree(state / "egress")
        (state / "egress").mkdir(mode=0o700)
        tail = _LogTail(log, progress, key)

        def beat() -> None:
            tail.poll()
            if heartbeat is not None:
                heartbeat()  # the task's lease, and a stop request

        try:
            result = backend.run(run_spec, heartbeat=beat, heartbeat_s=HEARTBEAT_S)
        except FilaError as e:
            record = EnvironmentRecord(**common, how="failed", log_path=log_rel)
            raise EnvironmentFailed(f"the environment's setup could not run: {e}", record=record) from e
        finally:
            fsutil.remove_tree(state / "egress")
        tail.poll()
    seconds = round(time.monotonic() - t0, 3)
    egress: EgressRecord | None = result.egress
    record = EnvironmentRecord(**common, how="failed", setup_s=seconds, log_path=log_rel, egress=egress)
    if result.committed is None:
        why = (
            f"timed out after {setup.timeout_ms / 1000:g} s (environment.timeout_ms)"
            if result.timed_out
            else f"broke a limit: {result.limit_exceeded}"
            if result.limit_exceeded
            else f"killed: out of memory (environment.memory {setup.memory})"
            if result.oom_killed
            else f"exited with code {result.exit_code}"
        )
        denied = sorted(
            {f"{r.host}:{r.port}" for r in (egress.requests if egress else []) if not r.allowed and r.host}
        )
        more = f"; refused hosts: {', '.join(denied)}" if denied else ""
        raise EnvironmentFailed(
            f"the environment's setup {why}{more}; see {log_rel}",
            record=record,
            hint="fix the setup commands, or add the hosts it needs to the policy's environment.allow",
        )
    try:
        for v, rel in zip(volumes, spec.provided, strict=True):
            progress(f"environment {key[:12]}: copying {rel} into volume {v.name} (once)")
            backend.fill_volume(result.committed, f"{PROJECT_PATH}/{rel}", v.name,  # type: ignore[attr-defined]
                                {LABEL: "1", KEY_LABEL: key}, max_bytes=setup.max_image_bytes)  # fmt: skip
    except FilaError as e:
        for v in volumes:  # this build's own, and only those
            backend.remove_named_volume(v.name)  # type: ignore[attr-defined]
        backend.remove_image(partial)
        raise EnvironmentFailed(
            f"the environment's provided paths could not be kept: {e}", record=record
        ) from e
    backend.tag_image(result.committed, tag)
    backend.remove_image(partial)
    info = backend.image_info(tag)
    assert info is not None
    _write_meta(
        state, {"setup_s": seconds, "log_path": log_rel, "built_at": now_iso(), "source": declared.source}
    )
    progress(f"environment {key[:12]}: built in {seconds:g} s ({tag})")
    record = record.model_copy(update={"how": "built", "image": ImageRef(tag=tag, id=info.id)})
    return Prepared(declared, key, record.image, record, volumes)  # type: ignore[arg-type]


def setup_credentials(setup: SetupPolicy) -> list[str]:
    """Each setup route's credential in every form the log's redaction looks for (a Basic one's
    decoded `user:password` and password too), read on this host; InvalidPolicy naming the route
    and its variable or file when one cannot be read."""
    out = []
    for name, route in setup.routes.items():
        base = f"environment.routes.{name}"
        egress.check_credential(base, route)
        fmt = egress.route_shape(name, route)[2]
        out += egress.credential_forms(fmt, egress.read_credential(base, route))
    return out


def route_vars(setup: SetupPolicy) -> list[str]:
    """The variables that hand the setup its routes' URLs (the gateway's FILA_ROUTE_<NAME>)."""
    return [f"FILA_ROUTE_{name.upper()}" for name in setup.routes]


def setup_policy(policy: Policy, setup: SetupPolicy) -> Policy:
    """The setup container's policy: the task's, with the setup's network (its routes the
    engine's never), time and resources."""
    network = "allowlist" if setup.allow or setup.learn or setup.routes else "none"
    egress_ = (
        Egress(
            allow=setup.allow,
            routes=setup.routes,
            allow_private=setup.allow_private,
            max_requests=setup.max_requests,
            learn=setup.learn,
            egress_network=setup.egress_network
            or (policy.egress.egress_network if policy.egress else "fila-egress"),
        )
        if network == "allowlist"
        else None
    )
    timeout = max(setup.timeout_ms, 1000)
    return policy.model_copy(
        update={
            "network": network,
            "egress": egress_,
            "max_timeout_ms": timeout,
            "default_timeout_ms": timeout,
            "memory": setup.memory,
            "cpus": setup.cpus,
            "pids": setup.pids,
            "fsize": setup.fsize,
            "tmpfs": Tmpfs(tmp="2g", home="2g"),
            "max_work_bytes": policy.max_work_bytes,
        }
    )


def _ca_bytes(ca_file: str | None) -> bytes | None:
    if ca_file is None:
        return None
    try:
        return Path(ca_file).read_bytes()
    except OSError as e:
        raise InvalidInput(f"cannot read the policy's environment.ca_file: {e}", path=ca_file) from e


# What the usual package managers read for an extra CA bundle: set by the setup's script, so none
# of it is in the committed image's configuration.
CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "npm_config_cafile")


def stage_inputs(tmp: Path, spec: EnvSpec, inputs: keys.Inputs, *, ca: bytes | None = None) -> Path:
    """The setup's directory: its script, the inputs' bytes as read for the key, and the policy's
    CA bundle when it names one."""
    setup = tmp / "setup"
    (setup / "inputs").mkdir(parents=True)
    if ca is not None:
        (setup / "ca.crt").write_bytes(ca)
    for rel, data in inputs.files.items():
        dest = setup / "inputs" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    (setup / "setup.sh").write_text(script(spec, ca=ca is not None))
    for sub in ("input", "work"):  # the job directory's shape the backend checks; nothing in them
        (tmp / sub).mkdir()
    return setup


def script(spec: EnvSpec, *, ca: bool = False) -> str:
    """The setup as one POSIX sh script: the inputs copied to the project's path, then each step in
    order (a shell string by `sh -c`, an argv as it is, a parallel step's commands at once)."""
    lines = [
        "set -e",
        *([f"export {v}={SETUP_DIR}/ca.crt" for v in CA_VARS] if ca else []),
        f"mkdir -p {PROJECT_PATH}",
        f"cp -a {SETUP_DIR}/inputs/. {PROJECT_PATH}/",
        f"cd {PROJECT_PATH}",
    ]
    for step in spec.setup:
        lines.append(f"echo {shlex.quote(f'== fila setup: {step.name}')}")
        if step.parallel:
            for i, sub in enumerate(step.parallel):
                lines.append(f"( {_command(sub)} ) & pid{i}=$!")
            lines.append("failed=")
            for i, sub in enumerate(step.parallel):
                lines.append(f'wait $pid{i} || failed="$failed {shlex.quote(sub.name)}"')
            lines.append('if [ -n "$failed" ]; then echo "== fila setup: failed:$failed" >&2; exit 1; fi')
        else:
            lines.append(_command(step))
    lines.append("echo '== fila setup: done'")
    return "\n".join(lines) + "\n"


def _command(step: Step) -> str:
    if step.shell is not None:
        return f"/bin/sh -c {shlex.quote(step.shell)}"
    assert step.argv is not None
    return " ".join(shlex.quote(a) for a in step.argv)


class SetupWorkspace:
    """The setup's view (core/mounts.Workspace): its script and inputs read-only at /fila-setup;
    the project's path is made inside the container's own (committed) file system."""

    def __init__(self, job_dir: Path, setup: Path) -> None:
        self._job_dir, self._setup = job_dir, setup

    @property
    def job_dir(self) -> Path:
        return self._job_dir

    def mounts(self, target: str) -> list[Bind]:
        return [Bind(SETUP_DIR, self._setup, read_only=True)]

    def usage(self, *, max_bytes: int, max_files: int) -> tuple[int, int]:
        return 0, 0  # what the setup writes is measured in the container (SetupRun.max_bytes)

    def hand_over(self, uid: int, gid: int) -> None:
        for p in (self._setup, *self._setup.rglob("*")):
            p.chmod(p.stat().st_mode | 0o444 | (0o111 if p.is_dir() else 0))
        self._job_dir.chmod(0o755)

    def reclaim(self, owner: tuple[int, int] | None) -> list[str]:
        return []


def _volumes(spec: EnvSpec, names: list[str]) -> list[ProvidedVolume]:
    return [
        ProvidedVolume(target=f"{PROJECT_PATH}/{rel}", name=name)
        for rel, name in zip(spec.provided, names, strict=True)
    ]


def _volumes_ready(
    backend: Backend, key: str, spec: EnvSpec, info: ImageInfo | None
) -> list[ProvidedVolume] | None:
    """The provided volumes the environment's image names, when it is the key's and they all
    exist; else None (built again)."""
    if info is None or info.labels.get(KEY_LABEL) != key:
        return None
    names = named_volumes(info.labels, key)
    if len(names) != len(spec.provided):
        return None
    if not spec.provided:
        return []
    have = {v["Name"] for v in backend.labelled_volumes(f"{KEY_LABEL}={key}")}  # type: ignore[attr-defined]
    return _volumes(spec, names) if all(n in have for n in names) else None


def _read_meta(state: Path) -> dict[str, Any]:
    try:
        data = json.loads((state / "setup.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_meta(state: Path, meta: dict[str, Any]) -> None:
    fsutil.atomic_write(state / "setup.json", json.dumps(meta, indent=2) + "\n")


@contextmanager
def _locked(state: Path) -> Iterator[None]:
    """One setup per key on this host at a time: a second task of the same key waits, then finds
    the image."""
    state.mkdir(parents=True, exist_ok=True)
    with fsutil.file_lock(state / ".lock"):
        yield


class _LogTail:
    """The setup log's step lines as progress while it runs (an environment build shows its steps)."""

    def __init__(self, log: Path, progress: Callable[[str], None], key: str) -> None:
        self.log, self.progress, self.key, self.pos = log, progress, key, 0

    def poll(self) -> None:
        try:
            with self.log.open("rb") as f:
                f.seek(self.pos)
                chunk = f.read(1 << 20)
        except OSError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        self.pos += end + 1
        for line in chunk[: end + 1].decode(errors="replace").splitlines():
            if line.startswith("== fila setup: "):
                self.progress(f"environment {self.key[:12]}: {line[len('== fila setup: ') :]}")


def state_dir(root: Root, key: str) -> Path:
    """The key's directory under envs_dir: a direct child named by a well-formed key, or
    InvalidInput (a key from a label is not trusted to name a path)."""
    if not valid_key(key):
        raise InvalidInput(f"{key[:80]!r} is not an environment's key (64 hex digits)")
    return envs_dir(root) / key[:32]


def sweep_setup_gateways(root: Root) -> list[str]:
    """The setup gateways' directories (their routes' secrets) a setup that died left: each one
    whose key's lock no live setup holds is removed, and each hold (a build's gateway state) no
    live process holds (recovery calls this)."""
    removed = hold.sweep(root)
    try:
        states = sorted(envs_dir(root).iterdir())
    except FileNotFoundError:
        return removed
    for state in states:
        gw = state / "egress"
        if not re.fullmatch(r"[0-9a-f]{32}", state.name) or state.is_symlink() or not gw.exists():
            continue
        with fsutil.file_lock(state / ".lock", wait=False) as held:
            if held:
                fsutil.remove_tree(gw)
                removed.append(str(gw))
    return removed


def remove_state(root: Root, key: str) -> None:
    state = state_dir(root, key)
    if state.is_symlink() or state.resolve().parent != envs_dir(root).resolve():
        raise InvalidInput(f"{state} is not a directory of {envs_dir(root)}")
    shutil.rmtree(state, ignore_errors=True)
