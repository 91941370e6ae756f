"""`fila serve` over plain HTTP (Starlette's TestClient on the app; the real server where the bind
is the point): the pages, the decisions through the CLI's code, and the attacks of
docs/review-web.md, each beside its allowed counterpart. Tasks are made by the fake backend (no
container): what is tested is the review, not the sandbox."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from fila.core.errors import InvalidInput
from fila.core.layout import Root
from fila.core.models import Status
from fila.review import desk
from fila.web import accounts
from fila.web.server import check_bind, parse_bind
from fila.web.sessions import Throttle
from fila.web.views import Lister, Query
from tests.support.cli import fila
from tests.support.project import make_project, record
from tests.support.web import apply_form, client, csrf, login, make_task

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")

ORIGIN = {"Origin": "http://127.0.0.1"}
HOSTILE_NAME = "<img src=x onerror=alert(1)>.txt"


@pytest.fixture
def root(tmp_path: Path) -> Root:
    return make_project(tmp_path / "proj")


def status(root: Root, tid: str) -> str:
    return record(root, tid)["status"]


def test_the_list_orders_counts_filters_and_follows_as_json(root: Root) -> None:
    a = make_task(root, "echo a > greeting.txt", prompt="rename the greeting")
    b = make_task(root, "echo b > greeting.txt", prompt="translate it")
    c_ = make_task(root, "echo c > greeting.txt", prompt="another greeting")
    assert fila(root, "reject", a, "--reason", "no").exit_code == 0
    c = client(root)
    page = c.get("/")
    assert page.status_code == 200
    # needs_review first, oldest first; the rejected one last
    assert page.text.index(b) < page.text.index(c_) < page.text.index(a)
    got = c.get("/api/tasks").json()
    assert [r["id"] for r in got["rows"]] == [b, c_, a]
    assert got["counts"]["needs_review"] == 2 and got["counts"]["rejected"] == 1
    only = c.get("/api/tasks", params={"q": "GREETING", "status": "needs_review"}).json()
    assert [r["id"] for r in only["rows"]] == [c_] and only["total"] == 1
    assert c.get("/api/tasks", params={"engine": "codex"}).json()["rows"] == []
    assert [r["id"] for r in c.get("/api/tasks", params={"policy": "default"}).json()["rows"]] == [b, c_, a]
    assert c.get("/api/tasks", params={"status": "nonsense"}).status_code == 400
    # paged: the second page of two holds the third task; a page past the end shows the last
    lister = Lister(root, None)
    assert [r["id"] for r in lister.page(Query(page=2), per_page=2).rows] == [a]
    assert lister.page(Query(page=9), per_page=2).page == 2
    # a new task appears in what the page polls
    d = make_task(root, "echo d > greeting.txt")
    assert d in [r["id"] for r in c.get("/api/tasks").json()["rows"]]


def test_decisions_go_through_the_clis_code_and_name_the_account(root: Root) -> None:
    ok = make_task(root, "echo applied > greeting.txt")
    no = make_task(root, "echo rejected > greeting.txt")
    accounts.add(root, "rev")
    _, token = accounts.add(root, "rev2")
    c = client(root)
    assert login(c, "rev2", token).status_code == 303
    page = c.get(f"/task/{ok}")
    assert "echo applied" not in page.text and "+applied" in page.text  # the diff is shown
    r = c.post(f"/task/{ok}/apply", data=apply_form(page.text, reason="looks right"), headers=ORIGIN)
    assert r.status_code == 303 and r.headers["location"] == f"/task/{ok}"
    assert (root.path / "greeting.txt").read_text() == "applied\n"
    d = record(root, ok)["decision"]
    assert (d["action"], d["by"], d["reason"]) == ("applied", "rev2", "looks right")
    assert "applied to" in c.get(f"/task/{ok}").text  # the result shown once
    page = c.get(f"/task/{no}")
    r = c.post(f"/task/{no}/reject", data={"csrf": csrf(page.text), "reason": "not this"}, headers=ORIGIN)
    assert r.status_code == 303 and status(root, no) == "rejected"
    assert record(root, no)["decision"]["by"] == "rev2"
    # the form names the patch the page showed: another sha256, or none, is refused
    other = make_task(root, "echo other > greeting.txt")
    for seen in ("0" * 64, ""):
        page = c.get(f"/task/{other}")
        r = c.post(f"/task/{other}/apply", data=apply_form(page.text, sha256=seen), headers=ORIGIN)
        assert (
            r.status_code == 409
            and "not the one this page showed" in r.text
            and status(root, other) == "needs_review"
        )
    # refused by the same checks as the CLI: a decided task cannot be applied
    page = c.get(f"/task/{no}")
    r = c.post(f"/task/{no}/apply", data=apply_form(page.text), headers=ORIGIN)
    assert r.status_code == 409 and "already rejected by rev2" in r.text


def test_retry_queues_a_failed_task_again(root: Root) -> None:
    tid = make_task(root, "exit 3", status="failed")
    c = client(root)
    page, again = c.get(f"/task/{tid}"), c.get(f"/task/{tid}")
    assert 'id="retry-form"' in page.text and 'id="apply-form"' not in page.text
    r = c.post(f"/task/{tid}/retry", data={"csrf": csrf(page.text), "reason": "flaky"}, headers=ORIGIN)
    assert r.status_code == 303 and status(root, tid) == "queued"
    assert record(root, tid)["decision"]["action"] == "retried"
    r = c.post(f"/task/{tid}/retry", data={"csrf": csrf(again.text)}, headers=ORIGIN)
    assert r.status_code == 409  # queued: the state machine refuses it, as `fila retry` does


def test_script_and_markup_in_a_diff_a_file_name_and_a_prompt_are_inert(root: Root) -> None:
    tid = make_task(
        root,
        f"printf 'plain text\\n<script>alert(1)</script>\\n\\033[2J\\342\\200\\256x\\n' > greeting.txt; "
        f"echo '<b>bold</b>' > '{HOSTILE_NAME}'",
        prompt="<script>alert('prompt')</script> and plain words",
    )
    c = client(root)
    page = c.get(f"/task/{tid}")
    assert page.status_code == 200
    html = page.text
    # allowed: plain text reads as written
    assert "plain text" in html and "greeting.txt" in html
    # hostile: markup escaped, control and bidi characters shown as escapes, no raw tag
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;.txt" in html
    assert "<b>bold" not in html and "&lt;b&gt;bold&lt;/b&gt;" in html
    assert "\x1b" not in html and "\\x1b[2J" in html
    assert "\u202e" not in html and "\\u202e" in html
    # the only script the page loads is the server's own file, and the policy allows no other
    assert html.count("<script") == 1 and '<script src="/static/app.js" defer></script>' in html
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    listing = c.get("/").text
    assert "plain words" in listing and "<script>alert('prompt')" not in listing
    assert "&lt;script&gt;alert(&#39;prompt&#39;)&lt;/script&gt;" in listing
    # the JSON the script reads holds text only (it sets textContent), escapes included
    row = c.get("/api/tasks").json()["rows"][0]
    assert row["prompt"].startswith("<script>") and "\x1b" not in json.dumps(row)
    split = c.get(f"/task/{tid}", params={"view": "split"}).text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in split and "<script>alert" not in split


def test_a_post_from_another_origin_is_refused(root: Root) -> None:
    tid = make_task(root, "echo x > greeting.txt")
    c = client(root)
    form = apply_form(c.get(f"/task/{tid}").text)
    for headers in (
        {"Origin": "http://evil.example"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "http://127.0.0.1.evil.example"},
        {"Origin": "https://127.0.0.1"},  # the same host, another scheme: another origin
        {"Sec-Fetch-Site": "same-site"},
    ):
        r = c.post(f"/task/{tid}/apply", data=form, headers=headers)
        assert r.status_code == 403 and "another" in r.text, headers
        assert status(root, tid) == "needs_review"
    r = c.post(f"/task/{tid}/apply", data=form, headers={**ORIGIN, "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 303 and status(root, tid) == "applied"


def test_a_missing_spent_or_foreign_csrf_token_is_refused(root: Root) -> None:
    a = make_task(root, "echo a > greeting.txt")
    b = make_task(root, "echo b > greeting.txt")
    c, other = client(root), client(root)
    token = csrf(c.get(f"/task/{a}").text)
    foreign = csrf(other.get(f"/task/{b}").text)
    assert c.post(f"/task/{b}/reject", data={"reason": "x"}, headers=ORIGIN).status_code == 403
    assert (
        c.post(f"/task/{b}/reject", data={"csrf": foreign, "reason": "x"}, headers=ORIGIN).status_code == 403
    )
    assert status(root, b) == "needs_review"
    assert c.post(f"/task/{a}/reject", data={"csrf": token, "reason": "x"}, headers=ORIGIN).status_code == 303
    assert status(root, a) == "rejected"
    r = c.post(f"/task/{b}/reject", data={"csrf": token, "reason": "x"}, headers=ORIGIN)  # spent
    assert r.status_code == 403 and "spent" in r.text and status(root, b) == "needs_review"
    # the login form's token too: a login without it is refused before the name is looked at
    accounts.add(root, "rev")
    fresh = client(root)
    fresh.get("/login")
    assert fresh.post("/login", data={"name": "rev", "token": "x"}, headers=ORIGIN).status_code == 403


def test_sessions_need_a_login_and_a_revoked_token_opens_nothing(root: Root) -> None:
    tid = make_task(root, "echo x > greeting.txt")
    _, alice = accounts.add(root, "alice")
    _, bob = accounts.add(root, "bob")
    c, d = client(root), client(root)
    assert c.get("/").status_code == 303 and c.get("/").headers["location"] == "/login"
    assert c.get("/api/tasks").status_code == 401
    assert login(c, "alice", alice).status_code == 303 and c.get("/").status_code == 200
    assert login(d, "bob", bob).status_code == 303
    assert fila(root, "serve", "user", "revoke", "alice").exit_code == 0
    assert c.get("/api/tasks").status_code == 401  # her session ended with her token
    r = login(client(root), "alice", alice)
    assert r.status_code == 401 and "unknown name or token" in r.text
    assert d.get("/api/tasks").status_code == 200  # bob's is untouched
    page = d.get(f"/task/{tid}")
    assert d.post(f"/task/{tid}/apply", data=apply_form(page.text), headers=ORIGIN).status_code == 303


def test_a_reader_sees_but_cannot_decide(root: Root) -> None:
    tid = make_task(root, "echo x > greeting.txt")
    _, reader = accounts.add(root, "ro", "reader")
    _, rev = accounts.add(root, "rw")
    c = client(root)
    login(c, "ro", reader)
    page = c.get(f"/task/{tid}")
    assert page.status_code == 200 and "+x" in page.text and 'id="apply-form"' not in page.text
    r = c.post(f"/task/{tid}/apply", data=apply_form(page.text), headers=ORIGIN)
    assert r.status_code == 403 and "may read but not decide" in r.text
    assert status(root, tid) == "needs_review" and (root.path / "greeting.txt").read_text() == "hello\n"
    w = client(root)
    login(w, "rw", rev)
    page = w.get(f"/task/{tid}")
    assert w.post(f"/task/{tid}/apply", data=apply_form(page.text), headers=ORIGIN).status_code == 303
    assert record(root, tid)["decision"]["by"] == "rw"


def test_no_url_parameter_reads_outside_the_queue(root: Root) -> None:
    tid = make_task(root, "echo x > greeting.txt")
    secret = root.path.parent / "secret.txt"
    secret.write_text("SECRET-CONTENT\n")
    (root.fila / "out" / "..%2f..%2fsecret.txt").write_text("{}")  # a name only an unchecked id reaches
    c = client(root)
    assert c.get(f"/task/{tid}").status_code == 200  # allowed: a task's own id
    assert c.get(f"/api/task/{tid}/log", params={"offset": "0"}).status_code == 200
    assert c.get("/static/app.js").status_code == 200
    # ("/task/.." itself never reaches a server: clients resolve dot segments; encoded, it does)
    bad = [
        "...",
        "..%2f..%2fsecret.txt",
        "%2e%2e",
        "a%00b",
        "x%0a",
        "x%0A..",
        "%2e%2e%2fsecret.txt",
        "a" * 129,
    ]
    for name in bad:
        for url in (
            f"/task/{name}",
            f"/api/task/{name}",
            f"/api/task/{name}/log",
            f"/task/{name}?view=split",
        ):
            r = c.get(url)
            assert r.status_code in (400, 404, 405), (url, r.status_code)
            assert "SECRET-CONTENT" not in r.text
    for url in (
        "/static/../web/accounts.py",
        "/static/%2e%2e/app.py",
        "/static/..%2f..%2fsecret.txt",
        "/../secret.txt",
        "/task/../../secret.txt",
    ):
        r = c.get(url)
        assert r.status_code in (400, 404), (url, r.status_code)
        assert "SECRET-CONTENT" not in r.text and "import" not in r.text
    for q in ({"offset": "x"}, {"offset": "-99999999999999"}):
        r = c.get(f"/api/task/{tid}/log", params=q)
        assert r.status_code in (200, 400) and "SECRET-CONTENT" not in r.text
    assert c.get(f"/task/{tid}", params={"view": "../../secret.txt"}).status_code == 400
    token = csrf(c.get(f"/task/{tid}").text)
    for name in ("..", "%2e%2e"):
        r = c.post(f"/task/{name}/reject", data={"csrf": token}, headers=ORIGIN)
        assert r.status_code in (400, 404)
    assert c.post(f"/task/{tid}/../../x", data={"csrf": token}, headers=ORIGIN).status_code in (404, 405)


def test_a_record_changed_outside_fila_is_an_error_page_not_a_crash(root: Root) -> None:
    good = make_task(root, "echo x > greeting.txt")
    c = client(root)
    assert c.get(f"/task/{good}").status_code == 200
    root.record_path("broken").write_text('{"id": "broken", "status": "<script>x</script>"}')
    r = c.get("/task/broken")
    assert r.status_code == 500 and "cannot read" in r.text and "<script>x" not in r.text
    assert c.get("/api/task/broken").json()["error"].startswith("cannot read")
    assert good in [x["id"] for x in c.get("/api/tasks").json()["rows"]]  # the list still reads


def test_a_bind_beyond_loopback_needs_an_account(root: Root) -> None:
    check_bind(root, parse_bind("127.0.0.1:0"))  # allowed: loopback without accounts
    check_bind(root, parse_bind("[::1]:8080"))
    for bind in ("0.0.0.0:8080", "192.0.2.1:80", "example.com:80", "[::]:80"):
        with pytest.raises(InvalidInput, match="without accounts"):
            check_bind(root, parse_bind(bind))
    res = fila(root, "serve", "--bind", "0.0.0.0:0")
    assert res.exit_code == 2 and "without accounts" in res.output
    accounts.add(root, "rev")
    check_bind(root, parse_bind("0.0.0.0:8080"))  # with an account it may
    accounts.revoke(root, "rev")
    with pytest.raises(InvalidInput):
        check_bind(root, parse_bind("0.0.0.0:8080"))  # a revoked one does not count
    for bad in ("x", "1.2.3.4:99999", ":80", "[::1]"):
        with pytest.raises(InvalidInput):
            parse_bind(bad)


def test_a_loopback_server_without_accounts_answers_to_loopback_names_only(root: Root) -> None:
    c = client(root)
    assert c.get("/", headers={"Host": "localhost:8765"}).status_code == 200
    assert c.get("/", headers={"Host": "[::1]:8765"}).status_code == 200
    assert c.get("/", headers={"Host": "127.0.0.2:8765"}).status_code == 200  # a --bind 127.0.0.2
    for host in ("evil.example:8765", "[::1]evil.example", "127.0.0.1:80evil", "[::1]:x"):  # DNS rebinding
        r = c.get("/", headers={"Host": host})
        assert r.status_code == 421 and "loopback" in r.text, host


def test_without_accounts_only_the_one_time_link_makes_a_reviewer(root: Root) -> None:
    tid = make_task(root, "echo x > greeting.txt")
    mine = client(root)  # opened the link `fila serve` printed
    link = mine.app_config.local_link
    # another process on this host, on the same server, without the link
    stranger = client(root, app=mine.app)
    assert stranger.get("/").headers["location"] == "/login"
    assert "one-time login link" in stranger.get("/login").text
    assert stranger.get("/api/tasks").status_code == 401
    r = stranger.post(f"/task/{tid}/apply", data={"csrf": "x"}, headers=ORIGIN)
    assert r.status_code == 401 and status(root, tid) == "needs_review"
    for guess in ("", "x", mine.app_config.local_secret[:-1], mine.app_config.local_secret):
        r = stranger.get("/login/local", params={"secret": guess})  # the last: the link, spent
        assert r.status_code == 403 and "restart" in r.text
    assert stranger.get("/api/tasks").status_code == 401
    # allowed: the person who opened the link decides, recorded as the login name
    page = mine.get(f"/task/{tid}")
    assert mine.post(f"/task/{tid}/apply", data=apply_form(page.text), headers=ORIGIN).status_code == 303
    assert status(root, tid) == "applied" and link.startswith("/login/local?secret=")
    # once an account exists a link opens nothing and the local session ends
    again = client(root, local=False)
    accounts.add(root, "rev")
    assert again.get(again.app_config.local_link).status_code == 403
    assert mine.get("/api/tasks").status_code == 401


def test_failed_logins_are_slowed_but_a_right_token_is_never_refused(root: Root) -> None:
    _, token = accounts.add(root, "rev")
    _, other = accounts.add(root, "rev2")
    throttle = Throttle(base_delay_s=0.0, max_clients=3)
    c = client(root, throttle=throttle)
    assert login(c, "rev", "wrong").status_code == 401  # refused: a wrong token
    for _ in range(10):  # someone behind the same address (a proxy, a NAT) mistypes, often
        assert login(client(root, throttle=throttle), "rev", "wrong").status_code == 401
    # allowed: the right token from that address, at once, for anyone
    assert login(c, "rev2", other).status_code == 303
    assert login(client(root, throttle=throttle), "rev", token).status_code == 303
    slow = Throttle(base_delay_s=0.5, max_delay_s=4.0)
    assert [slow.failed("x") for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert slow.failed("y") == 0.5  # another address starts over
    for n in range(100):  # many addresses: the table keeps the most recent few
        throttle.failed(f"10.0.0.{n}")
    assert throttle.clients() == 3


def test_a_flood_of_login_forms_logs_nobody_out(root: Root, monkeypatch: pytest.MonkeyPatch) -> None:
    from fila.web import sessions

    monkeypatch.setattr(sessions, "MAX_SESSIONS", 5)
    _, token = accounts.add(root, "rev")
    c = client(root)
    assert login(c, "rev", token).status_code == 303 and c.get("/api/tasks").status_code == 200
    mine = c.cookies.get("fila_session")
    for _ in range(20):  # the same server, each request without a cookie: a new login form
        c.cookies.clear()
        assert c.get("/login").status_code == 200
    c.cookies.clear()  # the first session's cookie, sent as a browser keeps it
    assert c.get("/api/tasks", headers={"cookie": f"fila_session={mine}"}).status_code == 200


def test_the_session_cookie_is_httponly_strict_and_secure_over_tls(root: Root) -> None:
    _, token = accounts.add(root, "rev")
    plain = login(client(root), "rev", token).headers["set-cookie"]
    assert "HttpOnly" in plain and "SameSite=strict" in plain and "Secure" not in plain
    c = client(root, https=True)
    page = c.get("/login")
    r = c.post(
        "/login",
        data={"csrf": csrf(page.text), "name": "rev", "token": token},
        headers={"Origin": "https://127.0.0.1"},
    )
    assert (
        r.status_code == 303 and "Secure" in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
    )


def test_behind_a_tls_proxy_the_public_origin_is_this_servers(root: Root) -> None:
    from fila.web.server import parse_origin, server

    _, token = accounts.add(root, "rev")
    # (the client speaks TLS so its cookie jar keeps a Secure cookie, as the browser does)
    c = client(root, public_origin="https://review.example", https=True)
    proxied = {"Host": "review.example"}  # the proxy passes the browser's Host on
    page = c.get("/login", headers=proxied)
    assert page.status_code == 200 and page.headers["strict-transport-security"].startswith("max-age=")
    for bad in ("http://review.example", "https://evil.example"):
        r = c.post("/login", data={"csrf": csrf(page.text), "name": "rev", "token": token},
                   headers={**proxied, "Origin": bad})  # fmt: skip
        assert r.status_code == 403 and "another origin" in r.text
    page = c.get("/login", headers=proxied)
    r = c.post("/login", data={"csrf": csrf(page.text), "name": "rev", "token": token},
               headers={**proxied, "Origin": "https://review.example"})  # fmt: skip
    cookie = r.headers["set-cookie"]
    assert r.status_code == 303 and cookie.startswith("__Host-fila_session=") and "Secure" in cookie
    assert c.get("/api/tasks", headers=proxied).status_code == 200
    assert c.get("/", headers={"Host": "evil.example"}).status_code == 421  # still no other Host
    # allowed counterpart: without a public origin, plain HTTP has neither HSTS nor a Secure cookie
    assert "strict-transport-security" not in client(root).get("/login").headers
    assert parse_origin("https://Review.example:8443/") == "https://review.example:8443"
    for bad in ("review.example", "ftp://x", "https://x/path", "https://u@x", "https://x?q"):
        with pytest.raises(InvalidInput, match="not an origin"):
            parse_origin(bad)
    accounts.revoke(root, "rev")
    with pytest.raises(InvalidInput, match="a proxy"):  # a proxy brings others in: accounts first
        server(root, None, parse_bind("127.0.0.1:0"), public_origin="https://review.example")


def test_accounts_keep_only_a_hash_and_the_cli_manages_them(root: Root) -> None:
    res = fila(root, "serve", "user", "add", "alice", "--role", "reader", "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["name"] == "alice" and got["role"] == "reader" and got["token"].startswith("fila_")
    stored = accounts.path(root)
    assert got["token"] not in stored.read_text() and stat.S_IMODE(os.stat(stored).st_mode) == 0o600
    assert fila(root, "serve", "user", "add", "alice").exit_code == 4  # taken
    assert fila(root, "serve", "user", "add", "../x").exit_code == 2
    assert fila(root, "serve", "user", "add", "bob", "--role", "admin").exit_code == 2
    assert "alice  reader" in fila(root, "serve", "user", "ls").output
    assert fila(root, "serve", "user", "revoke", "alice").exit_code == 0
    assert fila(root, "serve", "user", "revoke", "nobody").exit_code == 5
    assert json.loads(fila(root, "serve", "user", "ls", "--json").stdout)[0]["revoked_at"]
    assert fila(root, "serve", "user", "add", "alice").exit_code == 4  # a revoked name is not reused


def test_a_compare_groups_members_side_by_side(root: Root) -> None:
    from tests.support.web import fake_env

    group = "g1"
    for tid, text in (("m1", "one"), ("m2", "two")):
        task = {"id": tid, "engine": "shell", "command": f"echo {text} > greeting.txt", "group": group,
                "targets": ["greeting.txt"], "prompt": "<u>both</u>"}  # fmt: skip
        (root.path / f"{tid}.json").write_text(json.dumps(task))
        res = fila(root, "submit", str(root.path / f"{tid}.json"))
        assert res.exit_code == 0, res.output
    assert fila(root, "run", "--once", env=fake_env(root)).exit_code == 0
    c = client(root)
    page = c.get(f"/group/{group}")
    assert page.status_code == 200 and page.text.count('href="/task/') == 2 and "greeting.txt" in page.text
    assert "&lt;u&gt;both&lt;/u&gt;" in page.text and "<u>" not in page.text
    assert f'href="/group/{group}"' in c.get("/").text
    assert c.get("/group/nope").status_code == 404
    assert c.get("/group/%2e%2e").status_code == 400


def test_the_check_its_result_and_its_log_are_shown(root: Root) -> None:
    tid = make_task(root, "echo x > greeting.txt", extra=("--check", "echo CHECKED '<i>'; cat greeting.txt"))
    page = client(root).get(f"/task/{tid}")
    assert 'id="check"' in page.text and "passed (exit 0)" in page.text
    assert "CHECKED &lt;i&gt;" in page.text and "<i>" not in page.text
    plain = make_task(root, "echo y > greeting.txt")
    assert 'id="check"' not in client(root).get(f"/task/{plain}").text
    # A task whose chosen id is `<id>.check` writes its own log, never the check's log of <id>.
    forged = make_task(root, "echo '214 passed'; echo z > greeting.txt", extra=("--id", f"{tid}.check"))
    assert forged == f"{tid}.check" and "214 passed" in (root.logs_dir / f"{forged}.log").read_text()
    page = client(root).get(f"/task/{tid}")
    assert "CHECKED &lt;i&gt;" in page.text and "214 passed" not in page.text
    assert json.loads(root.record_path(tid).read_text())["check"]["log_path"] == f"fila/logs/{tid}~check.log"


def test_an_older_records_check_log_is_read_at_its_old_name_and_no_other(root: Root) -> None:
    from fila.core.models import Record
    from fila.run.check import check_log

    def rec(log_path: str) -> Record:
        check = {"command": "true", "passed": True, "log_path": log_path}
        return Record.model_validate({"id": "old1", "status": "needs_review", "check": check})

    assert check_log(root, rec("fila/logs/old1.check.log")) == root.logs_dir / "old1.check.log"
    for other in ("fila/logs/old1~check.log", "fila/logs/old1.log", "fila/in/old1.json"):
        assert check_log(root, rec(other)) == root.logs_dir / "old1~check.log"


def test_a_running_tasks_log_follows_live(root: Root, tmp_path: Path) -> None:
    import subprocess
    import time

    from tests.support.cli import CLI, submit_shell
    from tests.support.web import fake_env

    go = tmp_path / "go"
    tid = submit_shell(
        root,
        f"echo first-line; while [ ! -e {go} ]; do sleep 0.05; done; echo second-line; echo x > greeting.txt",
    )
    env = {**os.environ, **fake_env(root), "FILA_ROOT": str(root.path)}
    worker = subprocess.Popen(
        [*CLI, "run", "--once"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        c = client(root)
        deadline = time.monotonic() + 60
        got = {"text": "", "offset": 0}
        while "first-line" not in got["text"]:  # the page's poll, until the engine has written
            assert time.monotonic() < deadline and worker.poll() is None, "no output while running"
            got = c.get(f"/api/task/{tid}/log", params={"offset": "0"}).json()
            time.sleep(0.05)
        assert c.get(f"/api/task/{tid}").json()["status"] == "running" and "second-line" not in got["text"]
        go.touch()
        assert worker.wait(60) == 0
        more = c.get(f"/api/task/{tid}/log", params={"offset": str(got["offset"])}).json()
        assert "second-line" in more["text"] and "first-line" not in more["text"]  # only what followed
    finally:
        go.touch()
        worker.wait(60)


def test_the_log_follows_from_an_offset(root: Root) -> None:
    tid = make_task(root, "echo line-one; echo line-two >&2; echo x > greeting.txt")
    data, end = desk.log_since(root, None, tid, 0, 1 << 20)
    assert b"line-one" in data and end == len(data)
    assert desk.log_since(root, None, tid, end, 100) == (b"", end)
    assert desk.log_since(root, None, tid, end + 50, 100)[0] == data[:100]  # rewritten: from its start
    got = client(root).get(f"/api/task/{tid}/log", params={"offset": "0"}).json()
    assert "line-one" in got["text"] and got["offset"] == end
    assert Status(record(root, tid)["status"]) == Status.needs_review


def test_a_body_over_the_cap_or_a_multipart_upload_is_refused_before_routing(root: Root) -> None:
    from fila.web.limits import MAX_BODY

    _, token = accounts.add(root, "rev")
    c = client(root)
    page = c.get("/login")
    # allowed: the login form, with a long token field under the cap
    r = c.post("/login", data={"csrf": csrf(page.text), "name": "rev", "token": "x" * 1000}, headers=ORIGIN)
    assert r.status_code == 401 and "unknown name or token" in r.text
    big = {"csrf": csrf(c.get("/login").text), "name": "rev", "token": "x" * (MAX_BODY + 1)}
    r = c.post("/login", data=big, headers=ORIGIN)
    assert r.status_code == 413 and "at most" in r.text

    def chunked() -> Any:
        yield b"name=rev&token="
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024

    r = c.post(
        "/login", content=chunked(), headers={**ORIGIN, "Content-Type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 413 and "over" in r.text
    r = c.post(
        "/login", files={"f": ("a.bin", b"x" * 10)}, data={"csrf": csrf(c.get("/login").text)}, headers=ORIGIN
    )
    assert r.status_code == 415 and "multipart" in r.text
    assert r.headers["content-security-policy"]  # the security headers on the refusal too
    assert login(c, "rev", token).status_code == 303


def test_a_large_diff_is_shown_in_part_and_says_what_was_left_out(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.web import views

    for name, value in (("MAX_FILE_ROWS", 30), ("MAX_ROWS", 45), ("MAX_LINE_CHARS", 100)):
        monkeypatch.setattr(views, name, value)
    small = make_task(root, "echo small > greeting.txt")
    page = client(root).get(f"/task/{small}").text  # allowed: a diff under the caps, whole
    assert "+small" in page and 'id="diff-cut"' not in page and "not shown" not in page
    big = make_task(
        root,
        "seq 1 100 | sed 's/^/line-/' > a.txt; seq 1 100 | sed 's/^/line-/' > b.txt; "
        "printf 'x%.0s' $(seq 1 300) > 0long.txt",
        ".",
    )
    c = client(root)
    html = c.get(f"/task/{big}").text
    assert "+line-1<" in html and "+line-25<" in html and "+line-99<" not in html
    assert html.count("more lines of this file not shown") == 2  # a.txt at its cap, b.txt at the total
    assert 'id="diff-cut"' in html and f"fila diff {big}" in html and "1 long lines cut" in html
    assert "x" * 101 not in html and "more characters)" in html
    split = c.get(f"/task/{big}", params={"view": "split"}).text
    assert "+line-99<" not in split and 'id="diff-cut"' in split
    parsed = []
    real = views.report.diff_files
    monkeypatch.setattr(views.report, "diff_files", lambda rv: parsed.append(rv) or real(rv))
    for _ in range(3):
        assert c.get(f"/task/{small}").status_code == 200
    assert len(parsed) == 1  # parsed once, then kept by its sha256


def test_a_slow_client_is_cut_off(root: Root, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from fila.web import limits, server
    from tests.support.web import live_server

    monkeypatch.setattr(server, "HEADER_DEADLINE_S", 0.5)
    monkeypatch.setattr(limits, "BODY_DEADLINE_S", 0.5)

    def exchange(port: int, data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # 30 s: a bound, not a measure
            s.sendall(data)
            got = b""
            while chunk := s.recv(65536):  # until the server closes the connection
                got += chunk
            return got

    with live_server(root) as (url, _first):
        port = int(url.rsplit(":", 1)[1])
        head = b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        assert exchange(port, head).startswith(b"HTTP/1.1 200")  # allowed: a whole request
        assert exchange(port, head[:20]) == b""  # half a request head: closed, unanswered
        post = b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\nname=x"
        assert exchange(port, post).startswith(b"HTTP/1.1 408")  # a body that never ends


def test_paths_and_raw_content_stay_in_the_servers_log(root: Root, caplog: pytest.LogCaptureFixture) -> None:
    tid = make_task(root, "echo x > greeting.txt")
    _, token = accounts.add(root, "rev")
    outsider = client(root)
    assert str(root.path) not in outsider.get("/login").text  # the queue's path: not before a login
    c = client(root)
    login(c, "rev", token)
    assert str(root.path) in c.get("/").text  # allowed: a reviewer sees which queue this is
    root.record_path("broken").write_text('{"id": "broken", "status": "SECRET-VALUE"}')
    r = c.get("/task/broken")
    assert r.status_code == 500 and "cannot read" in r.text and "SECRET-VALUE" not in r.text
    page = c.get(f"/task/{tid}")  # outside a git checkout: the refusal names no path
    r = c.post(f"/task/{tid}/apply", data=apply_form(page.text, branch="b"), headers=ORIGIN)
    said = r.text.split('id="error">', 1)[1].split("</main>", 1)[0]
    assert r.status_code == 400 and "… is not in a git checkout" in said and str(root.path) not in said
    logged = caplog.text
    assert "SECRET-VALUE" in logged and f"{root.path} is not in a git checkout" in logged


def test_logging_in_again_and_again_ends_only_ones_own_oldest_sessions(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fila.web import sessions

    monkeypatch.setattr(sessions, "MAX_PER_ACCOUNT", 3)
    _, alice = accounts.add(root, "alice")
    _, bob = accounts.add(root, "bob")
    first = client(root)
    assert login(first, "alice", alice).status_code == 303
    theirs = client(root, app=first.app)
    assert login(theirs, "bob", bob).status_code == 303
    latest = None
    for _ in range(5):
        latest = client(root, app=first.app)
        assert login(latest, "alice", alice).status_code == 303
    assert latest.get("/api/tasks").status_code == 200  # allowed: her newest session
    assert theirs.get("/api/tasks").status_code == 200  # bob's session is untouched
    assert first.get("/api/tasks").status_code == 401  # her oldest ended
    # a session unused for longer than the idle limit ends; one in use does not
    store = sessions.Sessions(idle_s=3600)
    idle, used = store.new(user="a", role="reviewer"), store.new(user="b", role="reviewer")
    idle.seen -= 3601
    assert store.get(used.sid) is used and store.get(idle.sid) is None


def test_file_names_that_may_read_as_others_are_quoted_and_warned_of(root: Root) -> None:
    tid = make_task(
        root,
        "echo a > 'a.txt '; echo b > \"$(printf '\\320\\260.txt')\"; "
        "echo c > 'x.txt (deleted)'; echo d > plain.txt",
        ".",
    )
    page = client(root).get(f"/task/{tid}").text
    warned = [w for w in page.split("<li>") if "a file name that may mislead" in w]
    assert len(warned) == 3 and not any("plain.txt" in w for w in warned)  # allowed: a plain name
    assert any("&#34;a.txt &#34;" in w and "space" in w for w in warned)
    assert any("&#34;\u0430.txt&#34;" in w and "beyond ASCII" in w for w in warned)
    assert any("&#34;x.txt (deleted)&#34;" in w and "kind" in w for w in warned)
    assert '<span class="name">"x.txt (deleted)"</span> (new)' in page  # the name quoted, its kind apart
    assert '<span class="name">"plain.txt"</span> (new)' in page
    assert (
        'a file name that may mislead (a part begins or ends with a space): "a.txt "'
        in fila(root, "review", tid).output
    )
