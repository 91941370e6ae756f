"""The ASGI application of `fila serve` (Starlette): the pages and JSON of the review queue, the
login, and the decisions, each a call to review/desk.py, the functions the command line calls
(docs/review-web.md).

Each request passes the same gate (`Gate`): the Host must be this server's when it serves a
loopback address without accounts (a page elsewhere cannot reach it through DNS rebinding); the
session must be an account's that is still active (or, without accounts, the session the
one-time login link `fila serve` printed made);
a state-changing request must come from this origin (Origin, Sec-Fetch-Site) and spend a CSRF
token of its session; a reader cannot decide. Every response carries a Content-Security-Policy
that runs no inline script and loads nothing from elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import re
import secrets
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from jinja2 import Environment, FileSystemLoader
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..core.errors import FilaError, InfraError, InvalidInput, NotFound, Refused
from ..core.layout import Root, check_id
from ..core.models import Status
from ..core.states import valid_id
from ..core.text import inert
from ..review import desk, report
from ..review.branch import apply_on_branch
from ..review.decision import DECIDABLE, decider
from . import accounts, limits, views
from .sessions import Session, Sessions, Throttle

if TYPE_CHECKING:
    from ..queue.pg.store import PgQueue

COOKIE = "fila_session"
# Over HTTPS the cookie's name carries the __Host- prefix: a browser then keeps it only if it is
# Secure, for this host alone (no Domain) and the whole path, so no sibling host can plant one.
SECURE_COOKIE = "__Host-fila_session"
HSTS = "max-age=31536000"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-store",
}
LOG_CHUNK = 256 << 10
LOG = logging.getLogger("fila.serve")
# An absolute path in a message: a slash after a space, a quote, an '=' or the start, up to a
# space, a quote or a colon.
ABSOLUTE = re.compile(r"""(?:(?<=^)|(?<=[\s'"(=]))/[^\s'":]+""")


@dataclass
class Config:
    """What one server serves and how: the queue (`db` None: the file queue under `root`), whether
    it listens on a loopback address only, and the slowing of failed logins."""

    root: Root
    db: PgQueue | None = None
    loopback: bool = True
    throttle: Throttle | None = None
    # Without accounts (loopback only): the one-time secret of the login link `fila serve`
    # prints, which makes the session of the person who started it.
    local_secret: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    # The origin browsers reach the server at through a TLS proxy ("https://review.example"):
    # accepted as the Host and the Origin, and when https the cookie is Secure and HSTS is sent.
    public_origin: str | None = None

    @property
    def local_link(self) -> str:
        """The path of the one-time login link (without accounts)."""
        return "/login/local?" + urlencode({"secret": self.local_secret})


class Denied(Exception):
    """A request the gate refuses: its status and what to say."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "[::1]"); a header that is not
    NAME, NAME:PORT, [IPv6] or [IPv6]:PORT is returned whole (and matches no name)."""
    if host.startswith("["):
        inner, _, rest = host.partition("]")
        return inner + "]" if rest == "" or (rest[:1] == ":" and rest[1:].isdigit()) else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host


def loopback_host(name: str) -> bool:
    """A Host name this host's own loopback answers to: localhost, or a loopback address."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def secure(cfg: Config, request: Request) -> bool:
    """Whether browsers reach this server over TLS: served with a certificate, or behind a TLS
    proxy named by --public-origin."""
    return request.url.scheme == "https" or (cfg.public_origin or "").startswith("https://")


def cookie_name(cfg: Config, request: Request) -> str:
    return SECURE_COOKIE if secure(cfg, request) else COOKIE


def set_session(cfg: Config, request: Request, resp: Response, s: Session) -> None:
    """The session's cookie: HttpOnly (no script reads it), SameSite=Strict (no other site's page
    sends it), Secure and __Host- prefixed when browsers come over TLS."""
    resp.set_cookie(
        cookie_name(cfg, request),
        s.sid,
        httponly=True,
        samesite="strict",
        path="/",
        secure=secure(cfg, request),
    )


def hide_paths(text: str) -> str:
    """`text` with every absolute path of the host shown as `…` (the pages say what failed; the
    server's log keeps where)."""
    return ABSOLUTE.sub("…", text)


def _status_of(e: FilaError) -> int:
    for kind, code in ((NotFound, 404), (InvalidInput, 400), (Refused, 409), (InfraError, 503)):
        if isinstance(e, kind):
            return code
    return 500


class Gate:
    """Who is asking, and whether they may (see the module's doc)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.sessions = Sessions()
        self.throttle = cfg.throttle or Throttle()
        self._local_secret: str | None = cfg.local_secret
        self._local_lock = threading.Lock()

    def accounts(self) -> dict[str, accounts.Account]:
        return accounts.load(self.cfg.root)

    def check_host(self, request: Request) -> None:
        host = request.headers.get("host") or ""
        if not self.cfg.loopback or (
            self.cfg.public_origin and host == urlsplit(self.cfg.public_origin).netloc
        ):
            return
        if not loopback_host(host_name(host)):
            raise Denied(421, "this server answers to its loopback address only (127.0.0.1, localhost)")

    def session(self, request: Request, *, login: bool = False) -> Session:
        """The request's session, an account's that is still active (or the local person's, made
        by the one-time link, when there are no accounts); Denied(401) when there is none and
        `login` is False."""
        self.check_host(request)
        known = self.accounts()
        s = self.sessions.get(request.cookies.get(cookie_name(self.cfg, request)))
        if s is not None and s.user is not None:
            acct = known.get(s.user) if not s.local else None
            still = (acct is not None and acct.active) if not s.local else not known
            if not still:
                self.sessions.drop(s.sid)
                s = None
        if s is not None and (s.user is not None or login):
            return s
        if not known and not self.cfg.loopback:
            raise Denied(403, "this server has no accounts: add one with `fila serve user add NAME`")
        if login:
            return s or self.sessions.new()
        raise Denied(401, "log in first")

    def local_login(self, request: Request, secret: str) -> Session:
        """The session of the person who started a server without accounts, made once by the
        secret of the link it printed; the link opens nothing after that, nor once an account
        exists."""
        self.check_host(request)
        if self.accounts() or not self.cfg.loopback:
            raise Denied(403, "this server has accounts: log in with a name and a token")
        with self._local_lock:
            want, ok = self._local_secret, False
            if want is not None and hmac.compare_digest(secret.encode(), want.encode()):
                self._local_secret, ok = None, True
        if not ok:
            raise Denied(
                403,
                "this login link is not this server's, or was used already: "
                "restart `fila serve` for a new one",
            )
        return self.sessions.new(user=decider(None), role="reviewer", local=True)

    def same_origin(self, request: Request) -> None:
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            raise Denied(403, f"refused: a request from another site ({site})")
        origin, host = request.headers.get("origin"), request.headers.get("host") or ""
        public = self.cfg.public_origin
        # Through the proxy (its Host) the browser's origin is the public one, and nothing else.
        own = public if public and host == urlsplit(public).netloc else f"{request.url.scheme}://{host}"
        if origin is not None and origin != own:
            raise Denied(403, "refused: a request from another origin")

    async def writer(
        self, request: Request, *, role: str | None = "reviewer", login: bool = False
    ) -> tuple[Session, Any]:
        """The session of a state-changing request and its form, once its origin and CSRF token
        are checked (the token spent); with `role`, the session's account must have it."""
        self.same_origin(request)
        s = self.session(request, login=login)
        form = await request.form(max_files=0, max_fields=limits.MAX_FIELDS, max_part_size=limits.MAX_BODY)
        if not self.sessions.spend(s, str(form.get("csrf") or "")):
            raise Denied(
                403, "refused: the form's token is missing, spent or not this session's; reload the page"
            )
        if role is not None and s.role != role:
            raise Denied(403, f"refused: {s.user} may read but not decide (role {s.role})")
        return s, form


def make_app(cfg: Config) -> Starlette:
    gate = Gate(cfg)
    here = resources.files(__package__)
    env = Environment(
        loader=FileSystemLoader(str(here / "templates")),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    lister = views.Lister(cfg.root, cfg.db)
    diffs = views.DiffCache()
    # The first read of a large queue parses every record (about 2.5 s for 10,000): done while
    # the server starts, not in the first person's request.
    threading.Thread(target=lister.warm, name="fila-serve-warm", daemon=True).start()
    where = cfg.db.where if cfg.db is not None else str(cfg.root.path)

    def page(request: Request, s: Session | None, name: str, status: int = 200, **ctx: Any) -> Response:
        notice = None
        if s is not None:
            notice, s.notice = s.notice, None
        body = env.get_template(name).render(
            user=s.user if s and s.user else None,
            role=s.role if s else None,
            local=bool(s and s.local),
            csrf=gate.sessions.mint(s) if s is not None else "",
            notice=notice,
            where=where if s is not None and s.user else "",  # the queue's path: for those logged in
            queue_kind="PostgreSQL queue" if cfg.db is not None else "file queue",
            **ctx,
        )
        resp = Response(body, status_code=status, media_type="text/html; charset=utf-8")
        if s is not None:
            set_session(cfg, request, resp, s)
        return resp

    def failed(request: Request, s: Session | None, e: Denied | FilaError) -> Response:
        if isinstance(e, Denied):
            status, msg, hint = e.status, e.message, None
        else:
            # The whole message goes to the server's log; the page says what failed and what to
            # do, without the host's paths (a file queue's, a checkout's, git's own words).
            status, msg, hint = _status_of(e), hide_paths(str(e)), hide_paths(e.hint or "")
            LOG.warning("%s %s: %s%s", request.method, request.url.path, e, f" ({e.hint})" if e.hint else "")
        if status == 401 and request.method == "GET" and not request.url.path.startswith("/api/"):
            return RedirectResponse("/login", status_code=303)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": inert(msg), "hint": inert(hint or "")}, status_code=status)
        return page(request, s, "error.html", status, message=inert(msg), hint=inert(hint or ""))

    def guarded(fn: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except (Denied, FilaError, OSError, ValueError) as e:
                if isinstance(e, (OSError, ValueError)):
                    # A record or file changed outside fila (it does not validate, it cannot be
                    # read): said as the queue's own error, not a traceback, its content (and
                    # the path) in the server's log only.
                    LOG.warning("%s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
                    e = FilaError(
                        f"cannot read what this page shows ({type(e).__name__}; the server's log says more)"
                    )
                s = None
                with contextlib.suppress(Denied, FilaError):
                    s = gate.session(request, login=True)
                return failed(request, s, e)

        return endpoint

    def query_of(request: Request) -> views.Query:
        p = request.query_params
        status = p.get("status") or None
        if status is not None and status not in Status.__members__:
            raise InvalidInput(
                f"unknown status {status!r}", hint="one of: " + ", ".join(s.value for s in views.ORDER)
            )
        try:
            page_no = int(p.get("page") or 1)
        except ValueError:
            raise InvalidInput("page is not a number") from None
        return views.Query(
            status=Status(status) if status else None,
            engine=p.get("engine", ""),
            policy=p.get("policy", ""),
            group=p.get("group", ""),
            q=p.get("q", "")[:500],
            page=page_no,
        )

    def task_id(request: Request) -> str:
        return check_id(request.path_params["task_id"])

    async def index(request: Request) -> Response:
        s = gate.session(request)
        q = query_of(request)
        got = await run_in_threadpool(lister.page, q)
        params = q.params()
        return page(
            request,
            s,
            "list.html",
            got=got,
            q=q,
            statuses=[x.value for x in views.ORDER],
            params=params,
            page_link=lambda n: "/?" + urlencode({**params, "page": n}),
        )

    async def api_tasks(request: Request) -> Response:
        gate.session(request)
        got = await run_in_threadpool(lister.page, query_of(request))
        return JSONResponse(got.to_json())

    async def task(request: Request) -> Response:
        s = gate.session(request)
        tid = task_id(request)
        view = request.query_params.get("view", "unified")
        if view not in ("unified", "split"):
            raise InvalidInput(f"unknown view {view!r}", hint="unified or split")

        def load() -> dict[str, Any]:
            rec = desk.record(cfg.root, cfg.db, tid)
            rv, problem = None, None
            try:
                rv = desk.review(cfg.root, cfg.db, tid)
            except FilaError as e:  # a changed DIFF.patch: the record is shown, the diff refused
                problem = inert(str(e)) + (f" ({inert(e.hint)})" if e.hint else "")
            tail, end = desk.log_since(cfg.root, cfg.db, tid, -report.LOG_TAIL_BYTES, report.LOG_TAIL_BYTES)
            diff = diffs.shown(rv) if rv is not None else views.Shown([], [])
            files = diff.files
            return {
                "rec": rec,
                "rv": rv,
                "problem": problem,
                "log": views.log_text(tail),
                "log_end": end,
                "files": files,
                "diff": diff,
                "pairs": [views.split(f.rows) for f in files] if view == "split" else None,
            }

        got = await run_in_threadpool(load)
        rec, rv = got["rec"], got["rv"]
        return page(
            request,
            s,
            "task.html",
            tid=tid,
            view=view,
            state=views.task_state(rec),
            sha256=rec.patch_sha256 or "",
            summary=views.summary(rv) if rv else [],
            warnings=rv.warnings if rv else [],
            check=views.check(cfg.root, cfg.db, rec),
            **{k: got[k] for k in ("problem", "log", "log_end", "files", "pairs", "diff")},
        )

    async def group(request: Request) -> Response:
        s = gate.session(request)
        name = request.path_params["group"]
        if not valid_id(name):
            raise InvalidInput(f"invalid group name {inert(name)!r}", hint="names are [A-Za-z0-9._-]{1,128}")
        c = await run_in_threadpool(desk.compare, cfg.root, cfg.db, name)
        return page(request, s, "group.html", c=views.comparison(c))

    async def api_task(request: Request) -> Response:
        gate.session(request)
        tid = task_id(request)
        rec = await run_in_threadpool(desk.record, cfg.root, cfg.db, tid)
        return JSONResponse(views.task_state(rec))

    async def api_log(request: Request) -> Response:
        gate.session(request)
        tid = task_id(request)
        try:
            offset = int(request.query_params.get("offset") or 0)
        except ValueError:
            raise InvalidInput("offset is not a number") from None
        data, end = await run_in_threadpool(desk.log_since, cfg.root, cfg.db, tid, offset, LOG_CHUNK)
        return JSONResponse({"text": views.log_text(data), "offset": end})

    async def decide(request: Request) -> Response:
        action = request.path_params["action"]
        if action not in ("apply", "reject", "retry"):
            raise Denied(404, f"no such decision {inert(action)!r}: apply, reject or retry")
        s, form = await gate.writer(request)
        tid = task_id(request)
        reason = str(form.get("reason") or "") or None
        by = None if s.local else s.user

        def run() -> str:
            if action == "apply":
                rec = desk.record(cfg.root, cfg.db, tid)
                seen = str(form.get("sha256") or "")
                if rec.status in DECIDABLE["apply"] and seen != (rec.patch_sha256 or ""):
                    # The page's form names the patch the reviewer read; another one is not applied.
                    raise Refused(
                        "refused: the patch is not the one this page showed "
                        f"(sha256 {inert(seen[:12]) or 'none'}, now {(rec.patch_sha256 or '-')[:12]})",
                        hint="reload the page and review the patch again",
                    )
                options = {
                    "by": by,
                    "reason": reason,
                    "three_way": form.get("three_way") == "on",
                    "allow_git_metadata": form.get("allow_git_metadata") == "on",
                    "allow_credential": form.get("allow_credential") == "on",
                }
                branch = str(form.get("branch") or "").strip()
                if branch:
                    _res, on = apply_on_branch(cfg.root, cfg.db, tid, branch, **options)
                    return (
                        f"committed as {on.commit} on the new branch {branch} of {on.top}; checkout untouched"
                    )
                res = desk.apply_task(cfg.root, cfg.db, tid, **options)
                return (
                    f"applied to {res.project}: {len(res.written)} written, {len(res.deleted)} deleted"
                    + "".join(f"; superseded {t}" for t in res.superseded)
                )
            if action == "reject":
                rec = desk.reject_task(cfg.root, cfg.db, tid, by=by, reason=reason)
                return f"rejected by {rec.decision.by if rec.decision else '-'}"
            rec = desk.retry_task(cfg.root, cfg.db, tid, by=by, reason=reason)
            return f"queued again (attempt {rec.attempt + 1} next)"

        s.notice = inert(await run_in_threadpool(run))
        return RedirectResponse(f"/task/{tid}", status_code=303)

    async def login_form(request: Request) -> Response:
        s = gate.session(request, login=True)
        if s.user is not None:
            return RedirectResponse("/", status_code=303)
        return page(request, s, "login.html", local_only=not gate.accounts())

    async def local_login(request: Request) -> Response:
        fresh = gate.local_login(request, request.query_params.get("secret", ""))
        resp = RedirectResponse("/", status_code=303)
        set_session(cfg, request, resp, fresh)
        return resp

    async def login(request: Request) -> Response:
        client = request.client.host if request.client else "?"
        s, form = await gate.writer(request, role=None, login=True)
        acct = accounts.check(gate.accounts(), str(form.get("name") or ""), str(form.get("token") or ""))
        if acct is None:
            await asyncio.sleep(gate.throttle.failed(client))
            return page(request, s, "login.html", 401, error="unknown name or token")
        gate.throttle.succeeded(client)
        gate.sessions.drop(s.sid)
        fresh = gate.sessions.new(user=acct.name, role=acct.role)
        resp = RedirectResponse("/", status_code=303)
        set_session(cfg, request, resp, fresh)
        return resp

    async def logout(request: Request) -> Response:
        s, _form = await gate.writer(request, role=None)
        gate.sessions.drop(s.sid)
        resp = RedirectResponse("/login", status_code=303)
        resp.delete_cookie(cookie_name(cfg, request), path="/", secure=secure(cfg, request))
        return resp

    routes = [
        Route("/", guarded(index)),
        Route("/api/tasks", guarded(api_tasks)),
        Route("/task/{task_id}", guarded(task)),
        Route("/group/{group}", guarded(group)),
        Route("/api/task/{task_id}", guarded(api_task)),
        Route("/api/task/{task_id}/log", guarded(api_log)),
        Route("/task/{task_id}/{action:str}", guarded(decide), methods=["POST"]),
        Route("/login", guarded(login_form), methods=["GET"]),
        Route("/login", guarded(login), methods=["POST"]),
        Route("/login/local", guarded(local_login), methods=["GET"]),
        Route("/logout", guarded(logout), methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(Path(str(here)) / "static")), name="static"),
    ]
    hsts = (cfg.public_origin or "").startswith("https://")
    return Starlette(
        routes=routes, middleware=[Middleware(SecurityHeaders, hsts=hsts), Middleware(limits.BodyLimit)]
    )


class SecurityHeaders:
    """Every response's security headers (HEADERS), the static files' and the errors' included;
    Strict-Transport-Security over TLS (served with a certificate, or `hsts`: behind a TLS proxy)."""

    def __init__(self, app: Any, *, hsts: bool = False) -> None:
        self.app, self.hsts = app, hsts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                tls = self.hsts or scope.get("scheme") == "https"
                extra = [
                    (k.lower().encode(), v.encode())
                    for k, v in {**HEADERS, **({"Strict-Transport-Security": HSTS} if tls else {})}.items()
                    if k.lower().encode() not in have
                ]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)
