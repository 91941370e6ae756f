"""The ASGI application of `fila serve` (Starlette): the pages and JSON of the review queue, the
login, and the decisions, each a call to review/desk.py, the functions the command line calls
(docs/review-web.md).

Each request passes the same gate (web/gate.py: the Host, the session, the origin and the CSRF
token, the role). Every response carries a Content-Security-Policy that runs no inline script
and loads nothing from elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..core.errors import FilaError, InfraError, InvalidInput, NotFound, Refused
from ..core.layout import check_id
from ..core.models import Status
from ..core.states import valid_id
from ..core.text import inert
from ..review import desk, report
from ..review.branch import apply_on_branch
from ..review.decision import DECIDABLE
from . import accounts, limits, views
from .gate import Config, Denied, Gate, cookie_name, secure, set_session
from .sessions import Session

if TYPE_CHECKING:
    pass

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


def hide_paths(text: str) -> str:
    """`text` with every absolute path of the host shown as `…` (the pages say what failed; the
    server's log keeps where)."""
    return ABSOLUTE.sub("…", text)


def _status_of(e: FilaError) -> int:
    for kind, code in ((NotFound, 404), (InvalidInput, 400), (Refused, 409), (InfraError, 503)):
        if isinstance(e, kind):
            return code
    return 500


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
