"""`fila doctor`: is this host able to run fila safely, checked rather than assumed.

It reports the container engine, the runtimes Docker has, the images built, whether every policy
of the root is valid, and runs a short self-test with real containers through fila's own sandbox:
under `network: none` the engine has no network interface but loopback, `input/` is read-only
(and `work/` writable: the counterpart), the engine holds no capability (CapEff 0); under
`network: allowlist` a listed host answers through the gateway and an unlisted one is refused
(its upstream: a small HTTP server of the doctor's own on an `--internal` network, named
`allowed.test` and `denied.test`, so nothing leaves the host).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import FilaError
from ..core.layout import Root
from ..core.models import Policy

if TYPE_CHECKING:
    from ..sandbox import Backend, RunSpec

UPSTREAM_PORT = 8000
GATEWAY_IMAGE_FOR_UPSTREAM = "fila/gateway:latest"  # python3 is in it; no other image is needed
SELF_TEST_TIMEOUT_MS = 15_000


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": not self.failed, "failed": self.failed, "seconds": self.seconds,
                "checks": [asdict(c) for c in self.checks]}  # fmt: skip


def run(
    root: Root,
    *,
    self_test: bool = True,
    progress: Callable[[str], None] = lambda _m: None,
    backend: Backend | None = None,
) -> Report:
    """Every check; a check that cannot run (the engine down) fails and names why."""
    from ..sandbox import get_backend, root_backend

    t0 = time.monotonic()
    rep = Report()
    rep.checks.append(_policies(root))
    answered = False
    owned = backend is None
    try:
        backend = backend or get_backend(root_backend(root))
        v = backend.describe()
        detail = f"{v['name']} {v.get('version')} (API {v.get('api')}) answers"
        slow = storage_note(v)
        if slow:
            detail += f"; SLOW STORAGE: {slow}"
        rep.checks.append(Check("engine", True, detail, v))
        answered = True
    except FilaError as e:
        rep.checks.append(Check("engine", False, f"{e} ({e.hint})" if e.hint else str(e)))
    try:
        if answered and backend is not None:
            rep.checks.append(_runtimes(backend, root))
            rep.checks.append(_images(backend))
            env = _environment(root, backend)
            if env is not None:
                rep.checks.append(env)
            if self_test:
                progress("doctor: self-test under network none")
                rep.checks += _self_test_none(backend)
                progress("doctor: self-test under network allowlist")
                rep.checks.append(_self_test_allowlist(backend))
    finally:
        if owned and backend is not None:
            backend.close()
    rep.seconds = round(time.monotonic() - t0, 2)
    return rep


def storage_note(described: dict[str, Any]) -> str | None:
    """What a storage driver that copies every image costs, or None. Not a failure (jobs run, and
    the sandbox holds), but every container's creation copies its image: on rootless Podman with
    vfs a spare gateway takes ~12 s to make and a job created meanwhile waits for it
    (docs/benchmarks.md, "egress")."""
    driver = described.get("storage")
    if driver != "vfs":
        return None
    return (
        f"{described.get('name', 'the engine')} stores images with vfs, which copies the whole image "
        "for every container (seconds per job and per spare gateway); configure overlay "
        "(kernel overlayfs, or fuse-overlayfs for rootless Podman) in storage.conf, then "
        "`podman system reset` (it removes local images)"
    )


def _policies(root: Root) -> Check:
    from ..queue.policy import load_policy, policy_names

    bad, good, learning = [], [], []
    for name in policy_names(root):
        try:
            p, _ = load_policy(root, name)
            good.append(name)
        except FilaError as e:
            bad.append(f"{name}: {e}")
            continue
        if p.egress is not None and p.egress.learn:
            # Not a failure (the operator chose it), but never a surprise: a learning policy lets
            # unlisted public hosts through (README, "Learn, then lock").
            learning.append(f"{name} (max_requests {p.egress.max_requests})")
    detail = f"valid: {', '.join(good) or 'none'}" + (f"; INVALID: {'; '.join(bad)}" if bad else "")
    if learning:
        detail += f"; LEARNING (unlisted hosts let through): {', '.join(learning)}"
    return Check("policies", not bad, detail, {"valid": good, "invalid": bad, "learning": learning})


def _runtimes(backend: Backend, root: Root) -> Check:
    """The runtimes the engine has; a policy asking for one that is missing fails the check."""
    from ..queue.policy import load_policy, policy_names

    have = backend.runtimes()
    missing = []
    for name in policy_names(root):
        with contextlib.suppress(FilaError):
            p, _ = load_policy(root, name)
            if p.runtime and backend.runtime_for(p) not in have:
                missing.append(f"policy {name} needs {backend.runtime_for(p)}")
    detail = f"{', '.join(have)}" + (
        f"; MISSING: {'; '.join(missing)} (scripts/docker-up)" if missing else ""
    )
    return Check("runtimes", not missing, detail, {"available": have, "missing": missing})


def _images(backend: Backend) -> Check:
    from ..egress.config import GATEWAY_IMAGE
    from ..sandbox import images

    found, absent = [], []
    for tag in [
        *(images.image_tag(e) for e in images.engines() if e not in images.SUPPORT_IMAGES),
        GATEWAY_IMAGE,
    ]:
        (found if backend.image(tag) else absent).append(tag)
    detail = f"built: {', '.join(found) or 'none'}" + (f"; not built: {', '.join(absent)}" if absent else "")
    # Informative: a missing engine image is reported when a task needs it, with the command.
    return Check("images", True, detail, {"built": found, "missing": absent})


def _environment(root: Root, backend: Backend) -> Check | None:
    """The root's project environment (docs/environments.md): where declared, its key, built or not.
    Informative unless the declaration itself is refused: a task would fail on it."""
    from ..env import manage

    st = manage.status(root, root.path, backend)
    if st is None:
        return None
    if st.get("source") is None:
        return Check("environment", False, st["problem"], st)
    if "key" not in st:
        return Check("environment", "problem" not in st or st.get("built") is False,
                     f"{st['source']}: {st.get('problem', 'not built')}", st)  # fmt: skip
    state = "built" if st["built"] else "not built yet (the first task builds it, or `fila env build`)"
    routes = "".join(
        f"; setup route {name}: " + ("credential readable" if why is None else f"{why} (a setup fails)")
        for name, why in (st.get("routes") or {}).items()
    )
    return Check("environment", True, f"{st['source']}: key {st['key'][:12]}, {state}{routes}", st)


# -- the self-test -------------------------------------------------------------------------------


def _spec(tmp: Path, image: str, argv: list[str], policy: Policy, tag: str) -> RunSpec:
    from ..sandbox import RunSpec
    from ..workspace.strategy import CopyWorkspace

    job_id = f"doctor-{tag}-{secrets.token_hex(4)}"
    job_dir = tmp / job_id
    (job_dir / "input").mkdir(parents=True)
    (job_dir / "work").mkdir()
    (job_dir / "input" / "pristine.txt").write_text("input\n")
    (job_dir / "TASK.md").write_text("fila doctor self-test\n")
    return RunSpec(
        job_id=job_id,
        workspace=CopyWorkspace(job_dir),
        image=image,
        argv=argv,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"},
        policy=policy,
        limits=None,
        timeout_ms=SELF_TEST_TIMEOUT_MS,
        log_path=tmp / f"{job_id}.log",
        labels={"fila.role": "doctor"},
        egress_dir=tmp / f"{job_id}.egress",
    )


def _policy(**kw: Any) -> Policy:
    base: dict[str, Any] = dict(max_timeout_ms=60_000, default_timeout_ms=SELF_TEST_TIMEOUT_MS, memory="256m")
    return Policy.model_validate(base | kw)


_NONE_SCRIPT = r"""
echo "ifaces: $(ls /sys/class/net | tr '\n' ' ')"
grep CapEff /proc/self/status
if echo x > /job/work/doctor.txt; then echo "work: writable"; fi
if echo x > /job/input/pristine.txt 2>/dev/null; then echo "input: WRITABLE"; else echo "input: read-only"; fi
"""


def _self_test_none(backend: Backend) -> list[Check]:
    from ..sandbox import images

    image = images.image_tag("shell")
    if backend.image(image) is None:
        why = f"{image} is not built (`fila images build shell`)"
        return [
            Check(n, False, f"not run: {why}") for n in ("no network", "input read-only", "no capabilities")
        ]
    with tempfile.TemporaryDirectory(prefix="fila-doctor-") as d:
        spec = _spec(Path(d), image, ["/bin/sh", "-c", _NONE_SCRIPT], _policy(network="none"), "none")
        try:
            res = backend.run(spec)
            out = spec.log_path.read_text(errors="replace")
        except FilaError as e:
            return [Check("no network", False, f"the container failed: {e}")]
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    ifaces = lines.get("ifaces", "?").split()
    cap = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("CapEff:")), "?")
    ran = res.exit_code == 0 and "ifaces" in lines
    return [
        Check(
            "no network",
            ran and ifaces == ["lo"],
            f"interfaces under network none: {' '.join(ifaces) or '?'}",
        ),
        Check(
            "input read-only",
            ran and lines.get("work") == "writable" and lines.get("input") == "read-only",
            f"work/ {lines.get('work', '?')}, input/ {lines.get('input', '?')}",
        ),
        Check("no capabilities", ran and cap != "?" and cap.strip("0") == "", f"CapEff {cap}"),
    ]


_CLIENT_SCRIPT = r"""
import urllib.request, urllib.error
for host in ("allowed.test", "denied.test"):
    try:
        with urllib.request.urlopen(f"http://{host}:PORT/", timeout=5) as r:
            print(host, r.status, r.read(40).decode(errors="replace").strip().replace(" ", "_"))
    except urllib.error.HTTPError as e:
        print(host, e.code, "refused")
    except Exception as e:
        print(host, "error", type(e).__name__)
""".replace("PORT", str(UPSTREAM_PORT))


def _self_test_allowlist(backend: Backend) -> Check:
    """A listed host answers through the gateway, an unlisted one on the same server is refused."""
    from ..egress.config import GATEWAY_IMAGE

    if not backend.allowlist:  # refused before any container: nothing runs weaker
        return Check("allowlist", True, f"not run: the {backend.name} backend refuses network allowlist")
    if backend.image(GATEWAY_IMAGE) is None:
        return Check(
            "allowlist", False, f"not run: {GATEWAY_IMAGE} is not built (`fila images build gateway`)"
        )
    tmp = Path(tempfile.mkdtemp(prefix="fila-doctor-"))
    token = secrets.token_hex(8)
    try:
        server = ["python3", "-c", _SERVER % (token, UPSTREAM_PORT)]
        with backend.test_upstream(
            GATEWAY_IMAGE_FOR_UPSTREAM, server, ["allowed.test", "denied.test"], role="doctor"
        ) as (net_name, subnet):
            policy = _policy(
                network="allowlist",
                images=["fila/*"],
                egress={
                    "allow": [{"host": "allowed.test", "port": UPSTREAM_PORT}],
                    "allow_private": [subnet],
                    "egress_network": net_name,
                },
            )
            spec = _spec(tmp, GATEWAY_IMAGE, ["python3", "-c", _CLIENT_SCRIPT], policy, "allowlist")
            res = backend.run(spec)
            out = spec.log_path.read_text(errors="replace")
    except FilaError as e:
        return Check("allowlist", False, f"the self-test failed to run: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    got = {parts[0]: parts[1:] for parts in (line.split() for line in out.splitlines()) if len(parts) >= 2}
    allowed = got.get("allowed.test", ["?"])
    denied = got.get("denied.test", ["?"])
    ok = (
        allowed[:2] == ["200", token]
        and denied[:1] != ["200"]
        and res.egress is not None
        and res.egress.denied >= 1
    )
    detail = (
        f"allowed.test -> {' '.join(allowed[:1])}"
        + (" (the upstream's token)" if allowed[1:2] == [token] else "")
        + f"; denied.test -> {' '.join(denied[:1])}"
        + (f" ({res.egress.denied} denied at the gateway)" if res.egress else "")
    )
    return Check("allowlist", ok, detail, {"output": out[-2000:]})


_SERVER = r"""
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"%s\n"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", %d), H).serve_forever()
"""


def render(rep: Report) -> str:
    lines = [f"{'ok  ' if c.ok else 'FAIL'}  {c.name:<16} {c.detail}" for c in rep.checks]
    lines.append(f"{len(rep.checks) - len(rep.failed)}/{len(rep.checks)} checks passed in {rep.seconds:g} s")
    return "\n".join(lines)


def to_json(rep: Report) -> str:
    return json.dumps(rep.to_dict())
