"""A throwaway test CA and server certificates, made with the openssl CLI (no crypto by hand)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

DAYS = "2"  # a test certificate lives for the test session


@dataclass(frozen=True)
class ServerCert:
    names: tuple[str, ...]
    cert: Path
    key: Path


@dataclass
class TestCA:
    """A CA in `dir`: `cert` is what clients trust (`curl --cacert`, the gateway's upstream_ca)."""

    __test__ = False  # not a pytest test class, despite the name

    dir: Path
    cert: Path
    key: Path
    issued: dict[str, ServerCert] = field(default_factory=dict)

    def issue(self, name: str, *more_names: str) -> ServerCert:
        """A server certificate for `name` (and `more_names`) as DNS subjectAltNames."""
        names = (name, *more_names)
        for n in names:
            if not re.fullmatch(r"[A-Za-z0-9*][A-Za-z0-9.*-]*", n):
                raise ValueError(f"not a DNS name: {n!r}")
        stem = name.replace("*", "_star_")
        key, csr, cert, ext = (self.dir / f"{stem}.{kind}" for kind in ("key", "csr", "crt", "ext"))
        ext.write_text(
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            "subjectAltName=" + ",".join(f"DNS:{n}" for n in names) + "\n"
        )
        _openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}",
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
            "-CAcreateserial", "-days", DAYS, "-sha256", "-extfile", str(ext), "-out", str(cert),
        )  # fmt: skip
        # The servers run as uid 65534 with these files bind-mounted read-only: a throwaway key
        # in the test's own temporary directory may be world-readable.
        key.chmod(0o644)
        issued = ServerCert(names=names, cert=cert, key=key)
        self.issued[name] = issued
        return issued


def _openssl(*args: str) -> None:
    res = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {res.stderr.strip()[-500:]}")


def make_ca(directory: Path, common_name: str = "fila test CA") -> TestCA:
    """A new CA (EC P-256, 2 days) in `directory`, which is created."""
    directory.mkdir(parents=True, exist_ok=True)
    key, cert = directory / "ca.key", directory / "ca.crt"
    _openssl(
        "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", DAYS, "-subj", f"/CN={common_name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    cert.chmod(0o644)
    return TestCA(dir=directory, cert=cert, key=key)
