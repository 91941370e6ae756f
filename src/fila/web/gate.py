"""The gate of `fila serve` (docs/review-web.md, "Safe to expose"): who is asking, and whether
they may. The Host must be this server's when it serves a loopback address (a page elsewhere
cannot reach it through DNS rebinding) or its public origin; the session must be an account's
that is still active (or, without accounts, the one the one-time login link made); a
state-changing request must come from this origin (Origin, Sec-Fetch-Site) and spend a CSRF
token of its session; a reader cannot decide.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from starlette.requests import Request
from starlette.responses import Response

from ..core.layout import Root
from ..review.decision import decider
from . import accounts, limits
from .sessions import Session, Sessions, Throttle

if TYPE_CHECKING:
    from ..queue.pg.store import PgQueue

COOKIE = "fila_session"
# Over HTTPS the cookie's name carries the __Host- prefix: a browser then keeps it only if it is
# Secure, for this host alone (no Domain) and the whole path, so no sibling host can plant one.
SECURE_COOKIE = "__Host-fila_session"


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
