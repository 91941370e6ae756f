"""The queue URL: what it may hold, how it is shown, how a failed connection is told
(docs/architecture.md, "The PostgreSQL queue").

A queue URL is `postgresql://[user@]host[:port]/dbname[?param=value...]` (libpq's URI form). The
password never travels in it: libpq reads it from `PGPASSWORD`, the password file (`PGPASSFILE`,
default ~/.pgpass, which libpq ignores unless it is 0600) or a service file (`PGSERVICEFILE`,
`?service=NAME`). A URL that embeds one is refused, and every message shows the queue through
`describe` (user, host, port, database, never a password), never by the URL itself; `mask`
hides what a server's or driver's message might still hold.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .errors import QueueAuthFailed, QueueUnreachable, QueueUrlInvalid

SCHEMES = ("postgresql://", "postgres://")
SECRET_PARAMS = frozenset({"password", "sslpassword"})  # libpq's names, after percent-decoding
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]{0,30}://")
_USERINFO_PW = re.compile(r"^(?P<scheme>[a-z]+://)(?P<user>[^:@/?#]*):(?P<pw>[^@/?#]*)@", re.IGNORECASE)
_PARAM_PW = re.compile(r"(?i)((?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]*)")
PASSWORD_HINT = (
    "put the password in PGPASSWORD or in a 0600 password file (~/.pgpass, or the file PGPASSFILE "
    "names), or use ?service=NAME with PGSERVICEFILE"
)


def mask(text: str) -> str:
    """`text` with any password in a URL's user info or a `password=` parameter replaced by ***."""
    text = _USERINFO_PW.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _PARAM_PW.sub(lambda m: f"{m[1]}***", text)


def _scheme(url: str) -> str:
    """The URL's scheme alone (what a message may show of a URL that is refused): any other part
    could hold a password that libpq or a pattern would read differently."""
    m = _SCHEME.match(url)
    return m[0] if m else "(no scheme)"


def parse(url: str) -> dict[str, str]:
    """The libpq parameters of a queue URL. Refuses (QueueUrlInvalid) another scheme, a URL
    libpq cannot read, and a URL that embeds a password. No message quotes the URL: a refused
    one shows its scheme, a readable one its `describe`."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    if not url.startswith(SCHEMES):
        raise QueueUrlInvalid(
            f"the queue URL (scheme {_scheme(url)}) is not a PostgreSQL URL",
            hint="give postgresql://USER@HOST[:PORT]/DBNAME",
        )
    try:
        params = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    except ProgrammingError:
        # libpq's own message quotes the URL, password included: it is dropped.
        raise QueueUrlInvalid(
            f"the queue URL ({_scheme(url)}...) cannot be read as a libpq URI",
            hint="give postgresql://USER@HOST[:PORT]/DBNAME; percent-encode any special character",
        ) from None
    secret = sorted(SECRET_PARAMS & params.keys())
    if secret:
        raise QueueUrlInvalid(
            f"the queue URL for {describe(params)} holds a {' and a '.join(secret)}; fila never "
            "takes one from a URL (it would show in process lists, shell history and logs)",
            hint=PASSWORD_HINT,
        )
    return params


def describe(params: dict[str, Any]) -> str:
    """`user@host:port/dbname` as libpq will resolve it (its environment defaults included), for
    messages: never a password."""
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    user = params.get("user") or os.environ.get("PGUSER") or "(your login name)"
    db = params.get("dbname") or os.environ.get("PGDATABASE") or user
    service = params.get("service") or os.environ.get("PGSERVICE")
    where = f"{user}@{host}:{port}/{db}"
    return f"{where} (service {service})" if service else where


_AUTH = re.compile(
    r"password authentication failed|authentication failed|no password supplied|"
    r"fe_sendauth|no pg_hba\.conf entry|role .* does not exist|peer authentication",
    re.IGNORECASE,
)
_NO_DB = re.compile(r'database ".*" does not exist', re.IGNORECASE)


def connect_error(err: Exception, params: dict[str, Any]) -> QueueUnreachable:
    """The fila error for a failed connection: wrong credentials, a missing database or an
    unreachable server, naming the queue (never the password) and what to do."""
    where = describe(params)
    said = mask(str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
    sqlstate = getattr(err, "sqlstate", None)
    if sqlstate in ("28P01", "28000") or _AUTH.search(str(err)):
        return QueueAuthFailed(
            f"the queue database {where} refused the credentials: {said}",
            hint=f"check the user in the URL; {PASSWORD_HINT}",
        )
    if sqlstate == "3D000" or _NO_DB.search(str(err)):
        return QueueAuthFailed(
            f"the queue database {where} does not exist: {said}",
            hint="create it (createdb), then run `fila queue init --queue URL`",
        )
    return QueueUnreachable(
        f"the queue database {where} does not answer: {said}",
        hint="check that PostgreSQL runs there and accepts connections (pg_isready), and the "
        "host and port in the URL",
    )


def connect(url: str, *, timeout: float = 10.0, autocommit: bool = False) -> Any:
    """One psycopg connection to the queue, or the fila error that says why not."""
    import psycopg

    params = parse(url)
    try:
        return psycopg.connect(url, connect_timeout=max(1, int(timeout)), autocommit=autocommit)
    except psycopg.OperationalError as e:
        raise connect_error(e, params) from None
