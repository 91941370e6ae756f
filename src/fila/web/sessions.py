"""Sessions, CSRF tokens and the slowing of failed logins for `fila serve` (docs/review-web.md,
"Safe to expose").

Sessions live in the server's memory only: a restart logs everyone out, and nothing a browser
holds can be forged into a session (the cookie is 32 random bytes naming an entry here). Every
page that holds a form gets a fresh CSRF token of its session; a state-changing request must
carry one, which is then spent: a token from another session, a spent one or none is refused.
A session of an account checks the account on every request, so a revoked token's sessions end
at once.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

SESSION_TTL_S = 12 * 3600
SESSION_IDLE_S = 2 * 3600  # a session unused this long ends
MAX_SESSIONS = 10_000
MAX_PER_ACCOUNT = 32  # an account's sessions (browsers, devices); its oldest ends first
MAX_TOKENS = 64  # forms a session may have open at once (tabs, pages); the oldest go first
MAX_CLIENTS = 4096  # addresses the login throttle remembers
MAX_COUNTED = 16  # failures counted per address: enough to reach the longest delay


@dataclass
class Session:
    sid: str
    user: str | None  # None: not logged in yet (the login form's session)
    role: str | None
    created: float
    seen: float = 0.0  # the last request (monotonic)
    local: bool = False  # the person running the server, when it has no accounts (loopback only)
    csrf: OrderedDict[str, None] = field(default_factory=OrderedDict)
    notice: str | None = None  # shown once on the next page (the result of a decision)


class Sessions:
    """The server's sessions, safe to use from the threads that serve requests."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, idle_s: float = SESSION_IDLE_S) -> None:
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self.ttl_s, self.idle_s = ttl_s, idle_s

    def new(self, user: str | None = None, role: str | None = None, *, local: bool = False) -> Session:
        now = time.monotonic()
        s = Session(sid=secrets.token_urlsafe(32), user=user, role=role, created=now, seen=now, local=local)
        with self._lock:
            if user is not None:
                # Logging in again and again ends that account's own oldest sessions, no one else's.
                mine = [k for k, v in self._by_id.items() if v.user == user]
                for k in mine[: max(0, len(mine) - MAX_PER_ACCOUNT + 1)]:
                    del self._by_id[k]
            self._by_id[s.sid] = s
            if len(self._by_id) > MAX_SESSIONS:
                # Anyone can make a login form's session: those go first, so a flood of them
                # cannot log a reviewer out.
                anon = next((k for k, v in self._by_id.items() if v.user is None and k != s.sid), None)
                if anon is not None:
                    del self._by_id[anon]
                else:
                    self._by_id.popitem(last=False)
        return s

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        with self._lock:
            s = self._by_id.get(sid)
            now = time.monotonic()
            if s is not None and (now - s.created > self.ttl_s or now - s.seen > self.idle_s):
                del self._by_id[sid]
                return None
            if s is not None:
                s.seen = now
            return s

    def drop(self, sid: str) -> None:
        with self._lock:
            self._by_id.pop(sid, None)

    def drop_user(self, user: str) -> None:
        with self._lock:
            for sid in [k for k, s in self._by_id.items() if s.user == user]:
                del self._by_id[sid]

    def mint(self, s: Session) -> str:
        """A fresh CSRF token of the session, for one form."""
        token = secrets.token_urlsafe(32)
        with self._lock:
            s.csrf[token] = None
            while len(s.csrf) > MAX_TOKENS:
                s.csrf.popitem(last=False)
        return token

    def spend(self, s: Session, token: str | None) -> bool:
        """True once for a token the session minted; False for any other, and for it again."""
        if not token:
            return False
        with self._lock:
            if token in s.csrf:
                del s.csrf[token]
                return True
        return False


class Throttle:
    """Failed logins slowed down: each failure from a client (its address) within `window_s`
    doubles the wait before the answer to its next failure, up to `max_delay_s`. A right token is
    never refused nor slowed: behind a proxy or a NAT many people share an address, and one
    person's typos must not lock the others out (a token is 32 random bytes: slowing guesses is a
    courtesy to the log, not what keeps it safe). The table of clients holds at most
    `max_clients` (the least recently failed forgotten first), so many addresses cannot grow it."""

    def __init__(
        self,
        *,
        window_s: float = 600.0,
        base_delay_s: float = 0.5,
        max_delay_s: float = 8.0,
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        self.window_s, self.max_clients = window_s, max_clients
        self.base_delay_s, self.max_delay_s = base_delay_s, max_delay_s
        self._lock = threading.Lock()
        self._fails: OrderedDict[str, deque[float]] = OrderedDict()

    def failed(self, client: str) -> float:
        """Count a failure; the delay to wait before answering it."""
        with self._lock:
            q = self._fails.pop(client, None) or deque(maxlen=MAX_COUNTED)
            now = time.monotonic()
            while q and now - q[0] > self.window_s:
                q.popleft()
            q.append(now)
            self._fails[client] = q  # the most recent last
            while len(self._fails) > self.max_clients:
                self._fails.popitem(last=False)
            return min(self.max_delay_s, self.base_delay_s * 2 ** (len(q) - 1))

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._fails.pop(client, None)

    def clients(self) -> int:
        """How many clients have failures counted."""
        with self._lock:
            return len(self._fails)
