"""Engine images: find, build, reuse, also on a host with no container registry.

Each `images/<engine>/Dockerfile` starts `ARG BASE=<public image>` / `FROM ${BASE}`. The base is
chosen automatically: `--base` when given; else the public BASE when it is present locally or can
be pulled; else (no registry) a local base built from what the host can reach. For the shell
engine that is a `FROM scratch` image around Debian's static busybox, fetched with apt. A
Dockerfile whose BASE names a local base (`fila/base-debian:local`: Debian minbase made with
debootstrap and `docker import`) gets that base built on first use and reused after.

An image is labelled with a hash of its build context, so a changed Dockerfile triggers a rebuild
and an unchanged one is reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..assets import shipped_dir
from ..core.errors import ImageMissing, InfraError, InvalidInput, UnknownEngine
from ..core.models import ImageRef

if TYPE_CHECKING:  # the backend is the caller's: sandbox/images.py never picks or imports one
    from .base import Backend, ImageInfo

Progress = Callable[[str], None]

LABEL_CONTEXT = "fila.context-sha256"
LABEL_BASE = "fila.base"
LABEL_CA = "fila.ca-sha256"
OFFLINE_BUSYBOX_TAG = "fila/base-busybox:local"
CA_DIR = "extra-ca"
CA_NAME = "fila-extra-ca.crt"

DEBIAN_TAG = "fila/base-debian:local"
LABEL_DEFINITION = "fila.definition-sha256"
DEBOOTSTRAP_TIMEOUT_S = 1800
# What defines the Debian base; its hash labels the image, so a change here rebuilds it.
DEBIAN = {
    "suite": "bookworm",
    "variant": "minbase",
    "mirror": "http://deb.debian.org/debian",
    # Extra packages for debootstrap's --include; images built FROM the base apt-get their own.
    "packages": [],
    # Plain http: apt checks signatures itself, and no TLS-intercepting proxy needs trusting.
    "sources": "deb http://deb.debian.org/debian bookworm main\n"
    "deb http://deb.debian.org/debian bookworm-updates main\n"
    "deb http://deb.debian.org/debian-security bookworm-security main\n",
    # Small images: no recommends, no docs or man pages; retry a flaky mirror.
    "apt_conf": 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\nAcquire::Retries "3";\n',
    "dpkg_cfg": "path-exclude=/usr/share/doc/*\npath-include=/usr/share/doc/*/copyright\n"
    "path-exclude=/usr/share/man/*\npath-exclude=/usr/share/info/*\n"
    "path-exclude=/usr/share/locale/*\npath-include=/usr/share/locale/locale.alias\n",
    "changes": [
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "ENV LANG=C.UTF-8",
        'CMD ["bash"]',
    ],
    "format": 1,
}

# Built around the busybox binary from Debian's busybox-static package. busybox creates its own
# applet links, so the image needs nothing from a registry.
_BUSYBOX_DOCKERFILE = """\
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "mkdir", "-p", "/usr/bin", "/sbin", "/usr/sbin", "/tmp", "/etc", "/root"]
RUN ["/bin/busybox", "--install", "-s"]
COPY passwd group /etc/
RUN ["/bin/busybox", "chmod", "1777", "/tmp"]
ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin
CMD ["sh"]
"""
_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"


# Images under images/ that are not engines: fila runs them beside an engine (or in tests). They
# build like an engine image (`fila images build gateway`: same context label, base and CA file).
SUPPORT_IMAGES: dict[str, str] = {
    "gateway": "the egress gateway of `network: allowlist` (mitmproxy with fila's addon)",
    "testnet": "test upstreams and the curl client of network tests (not an engine)",
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


def context_hash(path: Path) -> str:
    """sha256 over the relative names, exec bits and contents of the files in a build context."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        h.update(f"{rel}\0{f.stat().st_mode & 0o111:o}\0".encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


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
    if labels.get(LABEL_BASE) == DEBIAN_TAG and labels.get(LABEL_DEFINITION) != _definition_hash():
        return False  # built on a Debian base whose definition changed since (label inherited)
    return ca_hash is None or labels.get(LABEL_CA) == ca_hash


def _default_base(dockerfile: Path) -> str | None:
    m = re.search(r"^\s*ARG\s+BASE=(\S+)", dockerfile.read_text(), re.MULTILINE)
    return m.group(1) if m else None


# A build step as Docker's classic builder (`Step 3/12 : RUN ...`) and Podman (`[1/2] STEP 3/8: ...`)
# announce it.
_STEP_RE = re.compile(r"^(?:\[\d+/\d+\]\s+)?(?:Step|STEP)\s+(\d+)/(\d+)\s*:\s*(.*)$")
_ARG_RE = re.compile(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)=(\S+)", re.MULTILINE)
_URL_RE = re.compile(r"https?://[^\s\"'<>;|&)]+")
_INSTALL_RE = re.compile(r"\b(apt-get|pip3?|npm)\s+(?:-\S+\s+)*install\s+((?:[^;&|\\]+))")
# What a client says when the certificate it met is not one it trusts (a TLS-intercepting proxy):
# curl's exit 60, npm's and Node's error codes, pip's and Python's, apt's.
_UNTRUSTED_TLS_RE = re.compile(
    r"curl: \(60\)|SSL certificate problem|returned a non-zero code: 60\b|exit code: 60\b"
    r"|SELF_SIGNED_CERT_IN_CHAIN|UNABLE_TO_GET_ISSUER_CERT_LOCALLY|UNABLE_TO_VERIFY_LEAF_SIGNATURE"
    r"|unable to get local issuer certificate|self[- ]signed certificate in certificate chain"
    r"|CERTIFICATE_VERIFY_FAILED|SSLCertVerificationError|Certificate verification failed",
)
_NOISE_RE = re.compile(r"^\s*(?:--->|Removing intermediate container)")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # Docker colours a RUN's stderr
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_TAIL_LINES = 15


class BuildProgress:
    """The build's output for a person: one line per Dockerfile step (its stage, its instruction,
    what it fetches: URLs with the Dockerfile's ARG defaults filled in, packages installed), and
    Docker's raw stream only when `verbose`. The raw stream's last lines are kept for the error
    of a failed build (`tail`)."""

    def __init__(
        self,
        tag: str,
        dockerfile: str,
        progress: Progress,
        *,
        buildargs: dict[str, str] | None = None,
        verbose: bool = False,
    ) -> None:
        self.tag, self.progress, self.verbose = tag, progress, verbose
        self.args = dict(_ARG_RE.findall(dockerfile)) | (buildargs or {})
        self.stage = 0
        self.stage_name = ""
        self.tail: list[str] = []
        self.step = ""

    def __call__(self, line: str) -> None:
        kept = _ANSI_RE.sub("", line).rstrip()
        if kept.strip() and not _NOISE_RE.match(kept):  # layer ids and cleanup say nothing of why
            self.tail = [*self.tail[-(_TAIL_LINES - 1) :], kept]
        if self.verbose:
            self.progress(line)
        m = _STEP_RE.match(line.strip())
        if m is None:
            return
        n, total, text = m.groups()
        words = text.split()
        if words and words[0].upper() == "FROM":
            self.stage += 1
            self.stage_name = words[-1] if len(words) >= 4 and words[-2].upper() == "AS" else ""
        stage = f", stage {self.stage}" if self.stage else ""
        stage += f" ({self.stage_name})" if self.stage_name else ""
        self.step = f"Step {n}/{total}{stage}"
        if not self.verbose:
            self.progress(f"{self.tag}: {self.step}: {self.summary(text)}")

    def _expand(self, text: str) -> str:
        return re.sub(
            r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: self.args.get(m.group(1), m.group(0)), text
        )

    def summary(self, text: str) -> str:
        """`RUN apt-get install ...` becomes `RUN (fetching: apt-get install ca-certificates curl)`."""
        text = self._expand(" ".join(text.split()))
        words = text.split(" ", 1)
        if words[0].upper() != "RUN":
            return text if len(text) <= 100 else text[:97] + "..."
        body = words[1] if len(words) > 1 else ""
        fetched = [
            f"{tool} install " + " ".join(w for w in pkgs.split() if not w.startswith("-"))
            for tool, pkgs in _INSTALL_RE.findall(body)
        ]
        fetched += list(dict.fromkeys(_URL_RE.findall(body)))
        if fetched:
            return "RUN (fetching: " + "; ".join(f[:160] for f in fetched) + ")"
        return "RUN " + (body if len(body) <= 90 else body[:87] + "...")


def untrusted_tls(text: str) -> bool:
    """Whether a build's output shows a client refusing a certificate it does not trust."""
    return _UNTRUSTED_TLS_RE.search(text) is not None


def tls_hint(engine: str, ca_file: Path | None) -> str:
    """What to do when a build met a certificate it does not trust (a TLS-intercepting proxy)."""
    bundle = (
        f"the host's own bundle, {HOST_CA_BUNDLE}, which holds the proxy's CA when the host trusts it"
        if HOST_CA_BUNDLE.is_file()
        else "your proxy's root CA (PEM)"
    )
    given = f"--ca-file {ca_file} did not make it trusted; " if ca_file is not None else ""
    example = HOST_CA_BUNDLE if HOST_CA_BUNDLE.is_file() else Path("PROXY-CA.pem")
    return (
        f"{given}a TLS-intercepting proxy's certificate is not trusted in the build: pass its CA with "
        f"`fila images build {engine} --ca-file {example}` ({bundle})"
    )


def _stream_build(
    backend: Backend,
    context: Path,
    tag: str,
    *,
    buildargs: dict[str, str],
    labels: dict[str, str],
    nocache: bool,
    progress: Progress,
    verbose: bool = False,
    engine: str | None = None,
    ca_file: Path | None = None,
) -> ImageRef:
    dockerfile = context / "Dockerfile"
    text = dockerfile.read_text(errors="replace") if dockerfile.is_file() else ""
    out = BuildProgress(tag, text, progress, buildargs=buildargs, verbose=verbose)
    try:
        backend.build_context(context, tag, buildargs=buildargs, labels=labels, nocache=nocache, progress=out)
    except ImageMissing as e:
        # The cause is in the stream's last lines (the error chunk names only the exit code).
        seen = "\n".join(out.tail)
        shown = "" if verbose else "\n" + "\n".join(f"  | {ln}" for ln in out.tail)
        where = f" at {out.step}" if out.step else ""
        if untrusted_tls(seen + "\n" + e.message):
            raise ImageMissing(
                f"{e.message}{where}{shown}", hint=tls_hint(engine or tag, ca_file), path=e.path
            ) from e
        raise ImageMissing(f"{e.message}{where}{shown}", hint=e.hint, path=e.path) from e
    ref = backend.image(tag)
    if ref is None:
        raise ImageMissing(f"build of {tag} reported success but the image is missing")
    return ref


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


def offline_busybox_base(backend: Backend, *, progress: Progress = print) -> ImageRef:
    """`fila/base-busybox:local`: busybox from Debian's apt mirrors, no registry involved."""
    ref = backend.image(OFFLINE_BUSYBOX_TAG)
    if ref is not None:
        progress(f"offline base {OFFLINE_BUSYBOX_TAG}: reusing {ref.id}")
        return ref
    progress(f"offline base {OFFLINE_BUSYBOX_TAG}: building from Debian's busybox-static (apt)")
    with tempfile.TemporaryDirectory(prefix="fila-busybox-") as tmp:
        work = Path(tmp)
        try:
            subprocess.run(
                ["apt-get", "download", "busybox-static"],
                cwd=work,
                check=True,
                capture_output=True,
                timeout=300,
            )
            debs = sorted(work.glob("busybox-static_*.deb"))
            if not debs:
                raise FileNotFoundError("apt-get download left no busybox-static .deb")
            subprocess.run(
                ["dpkg-deb", "-x", str(debs[0]), str(work / "root")],
                check=True,
                capture_output=True,
                timeout=120,
            )
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            raise ImageMissing(
                f"cannot build the offline base {OFFLINE_BUSYBOX_TAG}: {e} "
                f"{detail.decode(errors='replace').strip()[-300:]}".strip(),
                hint="on Debian/Ubuntu run `apt-get update` first; elsewhere pass "
                "--base IMAGE naming an image that is present locally",
            ) from e
        ctx = work / "ctx"
        ctx.mkdir()
        shutil.copy2(work / "root" / "bin" / "busybox", ctx / "busybox")
        (ctx / "Dockerfile").write_text(_BUSYBOX_DOCKERFILE)
        (ctx / "passwd").write_text(_PASSWD)
        (ctx / "group").write_text(_GROUP)
        labels = {"fila": "1", LABEL_CONTEXT: context_hash(ctx)}
        return _stream_build(
            backend,
            ctx,
            OFFLINE_BUSYBOX_TAG,
            buildargs={},
            labels=labels,
            nocache=False,
            progress=progress,
        )


def _definition_hash() -> str:
    return hashlib.sha256(json.dumps(DEBIAN, sort_keys=True).encode()).hexdigest()


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].replace("\\040", " ") for line in f]
    return sorted((p for p in points if p.startswith(prefix)), reverse=True)


def _unmount_all(root: Path) -> None:
    """debootstrap mounts /proc and /sys in the target and may leave them on failure: removing
    the tree with a mount still inside it would reach into the host's."""
    for point in _mounts_under(root):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=60)
    left = _mounts_under(root)
    if left:
        raise InfraError(
            f"cannot unmount {', '.join(left)} left by debootstrap",
            hint="unmount them by hand (umount -l PATH), then delete the directory",
            path=root,
        )


def _debootstrap(root: Path, progress: Progress) -> None:
    if shutil.which("debootstrap") is None:
        raise ImageMissing(
            f"building {DEBIAN_TAG} needs Debian's debootstrap, which is not installed",
            hint="run scripts/docker-up (it installs it), or `apt-get install debootstrap`",
        )
    if os.geteuid() != 0:
        raise ImageMissing(
            f"building {DEBIAN_TAG} runs debootstrap, which needs root",
            hint="build it once as root (`sudo fila images build testnet`); later builds reuse it",
        )
    cmd = ["debootstrap", f"--variant={DEBIAN['variant']}"]
    if DEBIAN["packages"]:
        cmd.append("--include=" + ",".join(DEBIAN["packages"]))
    cmd += [str(DEBIAN["suite"]), str(root), str(DEBIAN["mirror"])]
    tail: list[str] = []
    try:
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail = [*tail[-20:], line.rstrip()]
                if line.startswith(("I: Retrieving", "I: Installing", "I: Base system", "E:", "W:")):
                    progress(f"debootstrap: {line.rstrip()}")
            rc = proc.wait(timeout=DEBOOTSTRAP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise ImageMissing(f"debootstrap failed to run: {e}", path=root) from e
    if rc != 0:
        # The work directory goes with the failure: keep the end of debootstrap's own log.
        log = root / "debootstrap" / "debootstrap.log"
        with contextlib.suppress(OSError):
            tail += log.read_text(errors="replace").splitlines()[-5:]
        raise ImageMissing(
            f"debootstrap of {DEBIAN['suite']} from {DEBIAN['mirror']} failed (exit {rc}): "
            + " | ".join(line for line in tail[-8:] if line.strip()),
            hint="check that the host reaches the Debian mirror (apt-get update), then build again",
        )


def _finish_rootfs(root: Path, ca: bytes | None) -> None:
    (root / "etc/apt/sources.list").write_text(str(DEBIAN["sources"]))
    (root / "etc/apt/apt.conf.d/90fila").write_text(str(DEBIAN["apt_conf"]))
    (root / "etc/dpkg/dpkg.cfg.d/90fila-nodoc").write_text(str(DEBIAN["dpkg_cfg"]))
    if ca is not None:
        # Where update-ca-certificates looks once an image installs ca-certificates; same name
        # and place as an engine image's extra-ca/ copy.
        dest = root / "usr/local/share/ca-certificates"
        dest.mkdir(parents=True, exist_ok=True)
        (dest / CA_NAME).write_bytes(ca)
    for junk in ("var/lib/apt/lists", "var/cache/apt/archives", "var/log"):
        for f in (root / junk).rglob("*"):
            if f.is_file() or f.is_symlink():
                f.unlink()
    for f in (root / "var/cache/apt").glob("*.bin"):
        f.unlink()


def debian_base(backend: Backend, *, ca_file: Path | None = None, progress: Progress = print) -> ImageRef:
    """`fila/base-debian:local`: Debian minbase from debootstrap, imported without a registry.

    Reused while its definition (`DEBIAN`) is unchanged and, when a CA file is given, it holds
    that CA; built otherwise (about a minute or two, once)."""
    definition = _definition_hash()
    ca = _read_ca(ca_file) if ca_file is not None else None
    ca_hash = hashlib.sha256(ca).hexdigest() if ca is not None else None
    img = backend.image_info(DEBIAN_TAG)
    if img is not None:
        labels = img.labels
        if labels.get(LABEL_DEFINITION) == definition and ca_hash in (None, labels.get(LABEL_CA)):
            progress(f"local base {DEBIAN_TAG}: reusing {img.id[:19]}")
            return ImageRef(tag=DEBIAN_TAG, id=img.id)
    progress(f"local base {DEBIAN_TAG}: building with debootstrap from {DEBIAN['mirror']} (once)")
    with tempfile.TemporaryDirectory(prefix="fila-debian-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        root = work / "root"
        try:
            _debootstrap(root, progress)
            _finish_rootfs(root, ca)
        finally:
            if root.exists():
                _unmount_all(root)
        archive = work / "rootfs.tar"
        try:
            subprocess.run(
                ["tar", "--numeric-owner", "--xattrs", "-C", str(root), "-cf", str(archive), "."],
                check=True,
                capture_output=True,
                timeout=600,
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise ImageMissing(f"cannot pack the Debian root filesystem: {e}", path=root) from e
        changes = [
            *DEBIAN["changes"],
            "LABEL fila=1",
            f"LABEL {LABEL_DEFINITION}={definition}",
            f"LABEL {LABEL_CA}={ca_hash or ''}",
        ]
        progress(f"local base {DEBIAN_TAG}: {backend.name} import")
        backend.import_image(archive, DEBIAN_TAG, changes)
    ref = backend.image(DEBIAN_TAG)
    if ref is None:
        raise ImageMissing(f"docker import of {DEBIAN_TAG} reported success but the image is missing")
    if img is not None and img.id != ref.id:
        _remove_if_untagged(backend, img.id)
    return ref


# Engines whose Dockerfile also builds on a local base when the public one is out of reach.
OFFLINE_BASES: dict[str, Callable[..., ImageRef]] = {"shell": offline_busybox_base}
# Bases that only exist locally: a Dockerfile naming one in `ARG BASE=` gets it built here.
LOCAL_BASES: dict[str, Callable[..., ImageRef]] = {DEBIAN_TAG: debian_base}


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


def _read_ca(ca_file: Path) -> bytes:
    try:
        data = ca_file.read_bytes()
    except OSError as e:
        raise InvalidInput(f"cannot read the CA bundle: {e}", path=ca_file) from e
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise InvalidInput(
            "the CA bundle holds no PEM certificate",
            path=ca_file,
            hint="pass a PEM file (-----BEGIN CERTIFICATE-----), e.g. your proxy's root CA",
        )
    return data


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
    ca = _read_ca(ca_file) if ca_file is not None else None
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
        ref = _stream_build(
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
        _remove_if_untagged(backend, old.id)
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


def _remove_if_untagged(backend: Backend, image_id: str) -> None:
    """Drop a replaced image that no tag names any more. Never by id while it has tags: that
    would delete every other tag of the same id (identical builds share an id)."""
    try:
        info = backend.image_info(image_id)
    except InfraError:
        return
    if info is not None and not info.tags:
        backend.remove_image(image_id)  # refused while a container still uses it


def ensure_image(engine: str, backend: Backend, *, progress: Progress = print) -> ImageRef:
    """The engine's image: reused when present and current (quietly), built when not."""
    tag = image_tag(engine)
    img = backend.image_info(tag)
    if img is not None:
        if _up_to_date(img, context_hash(engine_dir(engine)), None, None):
            return ImageRef(tag=tag, id=img.id)
        progress(f"{tag}: images/{engine}/ changed since it was built; rebuilding")
    return build(engine, backend, progress=progress)
