"""One image build through a backend, as a person follows it: the build context hashed (the
label that says an image is current), a CA file read, the build's output shown a line per
Dockerfile step, and a failed build's error explained (an untrusted TLS certificate names its fix).
sandbox/images.py decides what to build and when (docs/architecture.md, layers)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import ImageMissing, InfraError, InvalidInput
from ..core.models import ImageRef

if TYPE_CHECKING:  # the backend is the caller's: nothing here picks or imports one
    from .base import Backend

Progress = Callable[[str], None]

LABEL_CONTEXT = "fila.context-sha256"
LABEL_CA = "fila.ca-sha256"
CA_NAME = "fila-extra-ca.crt"


def context_hash(path: Path) -> str:
    """sha256 over the relative names, exec bits and contents of the files in a build context."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        h.update(f"{rel}\0{f.stat().st_mode & 0o111:o}\0".encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def read_ca(ca_file: Path) -> bytes:
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


def stream_build(
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


def remove_if_untagged(backend: Backend, image_id: str) -> None:
    """Drop a replaced image that no tag names any more. Never by id while it has tags: that
    would delete every other tag of the same id (identical builds share an id)."""
    try:
        info = backend.image_info(image_id)
    except InfraError:
        return
    if info is not None and not info.tags:
        backend.remove_image(image_id)  # refused while a container still uses it
