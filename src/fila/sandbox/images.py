"""Engine images: find, build, reuse, also on a host with no container registry.

Each `images/<engine>/Dockerfile` starts `ARG BASE=<public image>` / `FROM ${BASE}`. The base is
chosen automatically: `--base` when given; else the public BASE when it is present locally or can
be pulled; else (no registry) a local base built from what the host can reach. For the shell
engine that is a `FROM scratch` image around Debian's static busybox, fetched with apt. A
Dockerfile whose BASE names a local base (`fila/base-debian:local`: Debian minbase made with
debootstrap and `docker import`) gets that base built on first use and reused after.

An image is labelled with a hash of its build context, so a changed Dockerfile triggers a rebuild
and an unchanged one is reused.

This module decides what to build and when; the local bases are in `image_bases`, one build as a
person follows it (progress, a failure explained) in `image_build` (docs/architecture.md, layers).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..assets import shipped_dir
from ..core.errors import ImageMissing, InfraError, UnknownEngine
from ..core.models import ImageRef
from .image_bases import DEBIAN as DEBIAN
from .image_bases import DEBIAN_TAG, LOCAL_BASES, OFFLINE_BASES, definition_hash
from .image_bases import LABEL_DEFINITION as LABEL_DEFINITION
from .image_bases import debian_base as debian_base
from .image_bases import offline_busybox_base as offline_busybox_base
from .image_build import (
    CA_NAME,
    LABEL_CA,
    LABEL_CONTEXT,
    Progress,
    context_hash,
    read_ca,
    remove_if_untagged,
    stream_build,
)
from .image_build import HOST_CA_BUNDLE as HOST_CA_BUNDLE
from .image_build import BuildProgress as BuildProgress
from .image_build import untrusted_tls as untrusted_tls

if TYPE_CHECKING:  # the backend is the caller's: sandbox/images.py never picks or imports one
    from .base import Backend, ImageInfo

# Imported `as` themselves above: names of the local bases and of the build that callers and tests
# find here.

LABEL_BASE = "fila.base"
CA_DIR = "extra-ca"

# Images under images/ that are not engines: fila runs them beside an engine (or in tests). They
# build like an engine image (`fila images build gateway`: same context label, base and CA file).
SUPPORT_IMAGES: dict[str, str] = {
    "gateway": "the egress gateway of `network: allowlist` (mitmproxy with fila's addon)",
    "testnet": "test upstreams and the curl client of network tests (not an engine)",
    "testenv": "a project's own image in the environment tests: Python 3.11, Node 18, npm, git, make",
    "pkgindex": "the local package indexes of the environment tests (pypiserver, verdaccio)",
}
GATEWAY_IMAGE = "fila/gateway:latest"


def image_tag(engine: str) -> str:
    return f"fila/{engine}:latest"


def engines() -> list[str]:
    """Engines with an image definition under images/."""
    root = shipped_dir("images")
    return sorted(p.name for p in root.iterdir() if (p / "Dockerfile").is_file())


def engine_dir(engine: str) -> Path:
    path = shipped_dir("images") / engine
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", engine) or not (path / "Dockerfile").is_file():
        raise UnknownEngine(
            f"no image definition for engine '{engine}'",
            hint=f"engines with an image: {', '.join(engines()) or 'none'}",
            path=path,
        )
    return path


def find_image(backend: Backend, tag: str) -> ImageRef | None:
    return backend.image(tag)


def _up_to_date(img: ImageInfo, ctx_hash: str, base: str | None, ca_hash: str | None) -> bool:
    labels = img.labels or {}
    if LABEL_CONTEXT not in labels:
        return True  # built by a person with plain `docker build`: theirs to replace, not ours
    if labels[LABEL_CONTEXT] != ctx_hash:
        return False
    if base is not None and labels.get(LABEL_BASE) != base:
        return False
    if labels.get(LABEL_BASE) == DEBIAN_TAG and labels.get(LABEL_DEFINITION) != definition_hash():
        return False  # built on a Debian base whose definition changed since (label inherited)
    return ca_hash is None or labels.get(LABEL_CA) == ca_hash


def _default_base(dockerfile: Path) -> str | None:
    m = re.search(r"^\s*ARG\s+BASE=(\S+)", dockerfile.read_text(), re.MULTILINE)
    return m.group(1) if m else None


def _public_base_usable(backend: Backend, base: str, progress: Progress) -> bool:
    if backend.image_info(base) is not None:
        progress(f"base image {base}: present locally")
        return True
    progress(f"base image {base}: pulling")
    reason = backend.pull(base)
    if reason is not None:
        progress(f"base image {base}: cannot pull ({reason})")
        return False
    return True


def _choose_base(
    backend: Backend, engine: str, progress: Progress, ca_file: Path | None = None
) -> str | None:
    public = _default_base(engine_dir(engine) / "Dockerfile")
    if public in LOCAL_BASES:
        return LOCAL_BASES[public](backend, ca_file=ca_file, progress=progress).tag
    if public is None or _public_base_usable(backend, public, progress):
        return public
    offline = OFFLINE_BASES.get(engine)
    if offline is None:
        raise ImageMissing(
            f"the base image {public} of engine '{engine}' is not present and cannot be pulled",
            hint=f"load it (docker load) or pass --base IMAGE naming a local image like {public}",
        )
    progress(f"no registry reachable: building {engine} on the local offline base")
    return offline(backend, progress=progress).tag


def build(
    engine: str,
    backend: Backend,
    *,
    base: str | None = None,
    ca_file: Path | None = None,
    force: bool = False,
    progress: Progress = print,
    verbose: bool = False,
) -> ImageRef:
    """Build `fila/<engine>:latest`, or reuse it when its context, base and CA are unchanged.
    `progress` gets a line per Dockerfile step (BuildProgress); `verbose`: Docker's raw stream."""
    src = engine_dir(engine)
    tag = image_tag(engine)
    ctx_hash = context_hash(src)
    ca = read_ca(ca_file) if ca_file is not None else None
    ca_hash = hashlib.sha256(ca).hexdigest() if ca is not None else None
    old = backend.image_info(tag)
    if not force and old is not None and _up_to_date(old, ctx_hash, base, ca_hash):
        progress(f"{tag}: up to date ({old.id[:19]})")
        return ImageRef(tag=tag, id=old.id)
    chosen = base or _choose_base(backend, engine, progress, ca_file)
    progress(f"{tag}: building from {src}" + (f" on {chosen}" if chosen else ""))
    with tempfile.TemporaryDirectory(prefix=f"fila-build-{engine}-") as tmp:
        ctx = Path(tmp) / "ctx"
        shutil.copytree(src, ctx, symlinks=True)
        (ctx / CA_DIR).mkdir(exist_ok=True)
        if ca is not None:
            (ctx / CA_DIR / CA_NAME).write_bytes(ca)
        labels = {
            "fila": "1",
            LABEL_CONTEXT: ctx_hash,
            LABEL_BASE: chosen or "",
            LABEL_CA: ca_hash or "",
        }
        ref = stream_build(
            backend,
            ctx,
            tag,
            buildargs={"BASE": chosen} if chosen else {},
            labels=labels,
            nocache=force,
            progress=progress,
            verbose=verbose,
            engine=engine,
            ca_file=ca_file,
        )
    try:
        smoke_test(backend, engine, ref, progress)
    except ImageMissing:
        _untag_failed(backend, tag, old)
        raise
    if old is not None and old.id != ref.id:
        remove_if_untagged(backend, old.id)
    return ref


LABEL_ENGINE_VERSION = "fila.engine.version"
SMOKE_TIMEOUT_S = 120


def smoke_test(backend: Backend, engine: str, ref: ImageRef, progress: Progress = print) -> None:
    """An engine image's build-time check: its CLI prints the version the image is labelled with,
    and its help still lists every flag the adapter passes (a renamed flag fails the build, not a
    user's job). Then the image is tagged with that version too. Images without an adapter that
    declares checks (support images, shell) pass unchecked."""
    from ..engines import engine_names, get_engine

    if engine not in engine_names():
        return
    adapter = get_engine(engine)
    if not adapter.version_argv:
        return
    info = backend.image_info(ref.id or ref.tag)
    version = (info.labels if info is not None else {}).get(LABEL_ENGINE_VERSION)
    if not version:
        raise ImageMissing(
            f"{ref.tag} has no {LABEL_ENGINE_VERSION} label",
            hint=f"images/{engine}/Dockerfile must say LABEL {LABEL_ENGINE_VERSION}=<the CLI's version>",
        )
    code, out = backend.smoke_run(ref.id or ref.tag, adapter.version_argv)
    if code != 0 or version not in out:
        raise ImageMissing(
            f"smoke test of {ref.tag}: `{' '.join(adapter.version_argv)}` "
            + (f"exited {code}" if code != 0 else f"does not print {version}")
            + f": {out.strip()[-300:]!r}",
            hint=f"check the package version pinned in images/{engine}/Dockerfile",
        )
    for check in adapter.smoke:
        code, out = backend.smoke_run(ref.id or ref.tag, check.argv)
        missing = [flag for flag in check.expect if flag not in out]
        if code != 0 or missing:
            raise ImageMissing(
                f"smoke test of {ref.tag}: `{' '.join(check.argv)}` "
                + (f"exited {code}" if code != 0 else f"lists no {', '.join(missing)}")
                + f" (the {engine} adapter passes them)",
                hint=f"the CLI changed its flags: update src/fila/engines/{engine}.py for {version}",
            )
    repo = ref.tag.rpartition(":")[0]
    backend.tag_image(ref.id or ref.tag, f"{repo}:{version}")
    progress(f"{ref.tag}: smoke test passed ({engine} {version}); tagged {repo}:{version}")


def _untag_failed(backend: Backend, tag: str, old: ImageInfo | None) -> None:
    """A build that failed its smoke test must not stay `latest`: the previous image gets the tag
    back, or the tag goes."""
    if old is not None:
        # The build's own error matters more; the tag may then still point at the failed image.
        with contextlib.suppress(InfraError):
            backend.tag_image(old.id, tag)
    else:
        backend.remove_image(tag)


def ensure_image(engine: str, backend: Backend, *, progress: Progress = print) -> ImageRef:
    """The engine's image: reused when present and current (quietly), built when not."""
    tag = image_tag(engine)
    img = backend.image_info(tag)
    if img is not None:
        if _up_to_date(img, context_hash(engine_dir(engine)), None, None):
            return ImageRef(tag=tag, id=img.id)
        progress(f"{tag}: images/{engine}/ changed since it was built; rebuilding")
    return build(engine, backend, progress=progress)
