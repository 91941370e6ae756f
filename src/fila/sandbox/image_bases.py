"""Local base images, built without a registry: `fila/base-busybox:local` (Debian's static busybox,
fetched with apt) for an engine whose public base cannot be pulled, and `fila/base-debian:local`
(Debian minbase from debootstrap, imported) for a Dockerfile whose `ARG BASE=` names it
(docs/architecture.md, layers)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import ImageMissing, InfraError
from ..core.models import ImageRef
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

if TYPE_CHECKING:  # the backend is the caller's: nothing here picks or imports one
    from .base import Backend

OFFLINE_BUSYBOX_TAG = "fila/base-busybox:local"

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


# Debian's busybox-static before 1:1.36.1-5 (bookworm's 1.35) is built without wget's -T, and
# its wget crashes on the flag (a NULL write): a host whose apt offers that one gets trixie's.
BUSYBOX_FALLBACK_SOURCES = (
    "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "  # apt checks the signatures
    "http://deb.debian.org/debian trixie main\n"
)
# Labels the offline base whose wget takes -T: one without it (no fallback reachable) is rebuilt
# next time rather than reused.
_BUSYBOX_DEFINITION = hashlib.sha256((_BUSYBOX_DOCKERFILE + "wget -T SEC").encode()).hexdigest()


def _apt_download(work: Path, sources: str | None) -> Path:
    """busybox-static's busybox binary, from the host's apt lists or, with `sources`, from a
    private apt state (its own lists and cache under `work`, the host's untouched)."""
    work.mkdir(parents=True)
    opts: list[str] = []
    if sources is not None:
        (work / "lists" / "partial").mkdir(parents=True)
        (work / "cache" / "archives" / "partial").mkdir(parents=True)
        (work / "parts").mkdir()
        (work / "sources.list").write_text(sources)
        for k, v in (
            ("Dir::Etc::SourceList", work / "sources.list"),
            ("Dir::Etc::SourceParts", work / "parts"),
            ("Dir::State::Lists", work / "lists"),
            ("Dir::Cache", work / "cache"),
        ):
            opts += ["-o", f"{k}={v}"]
        subprocess.run(["apt-get", *opts, "update"], check=True, capture_output=True, timeout=300)
    subprocess.run(
        ["apt-get", *opts, "download", "busybox-static"],
        cwd=work,
        check=True,
        capture_output=True,
        timeout=300,
    )
    debs = sorted(work.glob("busybox-static_*.deb"))
    if not debs:
        raise FileNotFoundError("apt-get download left no busybox-static .deb")
    subprocess.run(
        ["dpkg-deb", "-x", str(debs[0]), str(work / "root")], check=True, capture_output=True, timeout=120
    )
    for rel in ("bin/busybox", "usr/bin/busybox"):  # usr-merged releases ship it in usr/bin
        if (work / "root" / rel).is_file():
            return work / "root" / rel
    raise FileNotFoundError(f"no busybox binary in {debs[0].name}")


def wget_has_timeout(busybox: Path) -> bool:
    """Whether this busybox's wget was built with -T (its usage lists `-T SEC` only then). A
    binary the host cannot run is taken as it is."""
    try:
        res = subprocess.run([str(busybox), "wget", "--help"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return True
    return b"-T SEC" in res.stdout + res.stderr


def offline_busybox_base(backend: Backend, *, progress: Progress = print) -> ImageRef:
    """`fila/base-busybox:local`: busybox from Debian's apt mirrors, no registry involved; one
    whose wget takes -T (the host's busybox-static, else Debian trixie's)."""
    img = backend.image_info(OFFLINE_BUSYBOX_TAG)
    if img is not None and img.labels.get(LABEL_DEFINITION) == _BUSYBOX_DEFINITION:
        progress(f"offline base {OFFLINE_BUSYBOX_TAG}: reusing {img.id[:19]}")
        return ImageRef(tag=OFFLINE_BUSYBOX_TAG, id=img.id)
    progress(f"offline base {OFFLINE_BUSYBOX_TAG}: building from Debian's busybox-static (apt)")
    with tempfile.TemporaryDirectory(prefix="fila-busybox-") as tmp:
        work = Path(tmp)
        try:
            busybox = _apt_download(work / "host", None)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            raise ImageMissing(
                f"cannot build the offline base {OFFLINE_BUSYBOX_TAG}: {e} "
                f"{detail.decode(errors='replace').strip()[-300:]}".strip(),
                hint="on Debian/Ubuntu run `apt-get update` first; elsewhere pass "
                "--base IMAGE naming an image that is present locally",
            ) from e
        timeout_ok = wget_has_timeout(busybox)
        if not timeout_ok:
            progress(
                f"offline base {OFFLINE_BUSYBOX_TAG}: the host's busybox has no wget -T; trying trixie's"
            )
            try:
                busybox = _apt_download(work / "fallback", BUSYBOX_FALLBACK_SOURCES)
                timeout_ok = wget_has_timeout(busybox)
            except (OSError, subprocess.SubprocessError) as e:
                progress(
                    f"offline base {OFFLINE_BUSYBOX_TAG}: cannot fetch trixie's ({e}); its wget -T crashes"
                )
        ctx = work / "ctx"
        ctx.mkdir()
        shutil.copy2(busybox, ctx / "busybox")
        (ctx / "Dockerfile").write_text(_BUSYBOX_DOCKERFILE)
        (ctx / "passwd").write_text(_PASSWD)
        (ctx / "group").write_text(_GROUP)
        labels = {"fila": "1", LABEL_CONTEXT: context_hash(ctx)}
        if timeout_ok:
            labels[LABEL_DEFINITION] = _BUSYBOX_DEFINITION
        ref = stream_build(
            backend,
            ctx,
            OFFLINE_BUSYBOX_TAG,
            buildargs={},
            labels=labels,
            nocache=False,
            progress=progress,
        )
    if img is not None and img.id != ref.id:
        remove_if_untagged(backend, img.id)
    return ref


def definition_hash() -> str:
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
    definition = definition_hash()
    ca = read_ca(ca_file) if ca_file is not None else None
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
        remove_if_untagged(backend, img.id)
    return ref


# Engines whose Dockerfile also builds on a local base when the public one is out of reach.
OFFLINE_BASES: dict[str, Callable[..., ImageRef]] = {"shell": offline_busybox_base}
# Bases that only exist locally: a Dockerfile naming one in `ARG BASE=` gets it built here.
LOCAL_BASES: dict[str, Callable[..., ImageRef]] = {DEBIAN_TAG: debian_base}
