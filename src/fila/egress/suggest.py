"""`fila policy suggest`: the smallest allowlist that would have let some runs do what they did,
read from what their gateways logged (README, "Learn, then lock").

Pure functions of the records' `egress` sections and the policy document: which host:port the
proxy door let through (listed or learned), the entries that cover exactly those (exact names;
`*.suffix` only when asked and several names below one suffix were used; methods for plain-HTTP
entries), the current entries no run used, and the new policy document with `learn` removed (the
lock). The gateway's log lines are the engine's doing, so every name is checked as a policy entry
would be (`config.validate`) before it is proposed, a method a policy cannot list is left out (with
a note), and a `*.suffix` is proposed only for a suffix that is itself a name the runs used or the
policy lists: the operator's own domain can be widened, never a public suffix (`github.io`,
`co.uk`) under which anyone registers names the engine chose.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.models import HTTP_METHOD_PATTERN, AllowEntry, Egress, EgressRecord, SetupPolicy

_METHOD = re.compile(HTTP_METHOD_PATTERN)


@dataclass
class Used:
    """What the runs did through the proxy door on one host:port."""

    tunnel: bool = False  # a CONNECT (TLS): no method is seen, the entry takes none
    methods: set[str] = field(default_factory=set)  # plain-HTTP requests' methods
    learned: bool = False
    odd: set[str] = field(default_factory=set)  # methods no policy entry can list (`M-SEARCH`, `get`)


def used_hosts(records: Iterable[EgressRecord]) -> dict[tuple[str, int], Used]:
    """(host, port) -> what was done there: every request the proxy door allowed, listed or learned."""
    out: dict[tuple[str, int], Used] = {}
    for rec in records:
        for r in rec.requests:
            if r.door != "proxy" or not r.allowed or not r.host or not r.port or not r.method:
                continue
            u = out.setdefault((r.host.lower().rstrip("."), r.port), Used())
            u.learned = u.learned or r.learned
            if r.method == "CONNECT":
                u.tunnel = True
            elif _METHOD.match(r.method):
                u.methods.add(r.method)
            else:
                u.odd.add(r.method)
    return out


def method_notes(used: dict[tuple[str, int], Used]) -> list[str]:
    """What `entries_for` left out because a policy cannot say it: methods outside the policy's
    method pattern (the proxy door passes any method to a learned name)."""
    out = []
    for (host, port), u in sorted(used.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if not u.odd:
            continue
        odd = ", ".join(sorted(u.odd))[:200]
        if u.tunnel or u.methods:
            out.append(f"{host}:{port}: methods left out (a policy lists {HTTP_METHOD_PATTERN} only): {odd}")
        else:
            out.append(f"{host}:{port} left out: used only with methods a policy cannot list ({odd})")
    return out


def listed_names(policy_doc: dict[str, Any]) -> set[str]:
    """The names the policy's allow entries give (a `*.suffix` entry gives its suffix): a suffix
    `entries_for` may widen to `*.suffix`."""
    out = set()
    for e in (policy_doc.get("egress") or {}).get("allow") or []:
        if isinstance(e, dict) and isinstance(e.get("host"), str):
            h = e["host"].lower().rstrip(".")
            out.add(h[2:] if h.startswith("*.") else h)
    return out


def entries_for(
    used: dict[tuple[str, int], Used], *, wildcards: bool = False, listed: Collection[str] = ()
) -> list[dict[str, Any]]:
    """The allow entries that cover `used` and nothing else: one per host:port, methods for a
    plain-HTTP one reached without a tunnel (a host:port used only with methods a policy cannot
    list is left out: `method_notes` says so). With `wildcards`, two or more names below one
    suffix on the same port and methods become `*.suffix` when the suffix (at least two labels:
    never `*.com`) is itself a name the runs used or one of `listed` (`listed_names` of the
    policy): a suffix the engine picked (`github.io`, `co.uk`) is never widened."""
    exact: list[dict[str, Any]] = []
    for (host, port), u in sorted(used.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if not u.tunnel and not u.methods and u.odd:
            continue  # an entry without methods would open every method there
        methods = sorted(u.methods) if (not u.tunnel and u.methods and port != 443) else None
        exact.append({"host": host, "port": port, "methods": methods})
    if not wildcards:
        return [_clean(e) for e in exact]
    known = {h for h, _ in used} | {h.lower().rstrip(".") for h in listed}
    groups: dict[tuple[str, int, tuple[str, ...] | None], list[dict[str, Any]]] = {}
    for e in exact:
        parent = e["host"].split(".", 1)[1] if "." in e["host"] else ""
        key = (parent, e["port"], tuple(e["methods"]) if e["methods"] else None)
        groups.setdefault(key, []).append(e)
    out: list[dict[str, Any]] = []
    for (parent, port, methods), members in groups.items():
        if parent.count(".") >= 1 and parent in known and len(members) >= 2:
            out.append({"host": f"*.{parent}", "port": port, "methods": list(methods) if methods else None})
        else:
            out += members
    return [_clean(e) for e in out]


def _clean(e: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = {"host": e["host"], "port": e["port"]}
    if e.get("methods"):
        d["methods"] = e["methods"]
    return d


def covers(entry: AllowEntry, host: str, port: int, u: Used) -> bool:
    if entry.port != port:
        return False
    hit = host.endswith(entry.host[1:]) if entry.host.startswith("*.") else host == entry.host
    if not hit:
        return False
    return entry.methods is None or (not u.tunnel and u.methods <= set(entry.methods))


def unused_entries(
    policy_doc: dict[str, Any],
    used: dict[tuple[str, int], Used],
    records: list[EgressRecord],
    section: str = "egress",
) -> list[str]:
    """The current policy's allow entries no run used, and its routes no run called (`section`
    environment: the setup's allowlist, the shipped registries when the policy names none)."""
    called = {name for rec in records for name, s in rec.routes.items() if s.requests}
    if section == "environment":
        # A setup route is never proposed as an allow entry (its host is the gateway's to reach,
        # with the credential): only named when no setup called it.
        setup = SetupPolicy.model_validate(policy_doc.get("environment") or {})
        return [f"environment.allow.{i} {e.host}:{e.port}" for i, e in enumerate(setup.allow)
                if not any(covers(e, h, p, u) for (h, p), u in used.items())] + [
            f"environment.routes.{name}" for name in setup.routes if name not in called]  # fmt: skip
    eg = Egress.model_validate(policy_doc.get("egress") or {})
    out = []
    for i, entry in enumerate(eg.allow):
        if not any(covers(entry, h, p, u) for (h, p), u in used.items()):
            out.append(f"egress.allow.{i} {entry.host}:{entry.port}")
    out += [f"egress.routes.{name}" for name in eg.routes if name not in called]
    return out


def locked_document(
    policy_doc: dict[str, Any], allow: list[dict[str, Any]], section: str = "egress"
) -> dict[str, Any]:
    """The policy document with `allow` as its `section`'s allowlist (`egress`, or `environment`
    for a setup) and learning off (the key removed)."""
    doc = copy.deepcopy(policy_doc)
    eg = dict(doc.get(section) or {})
    eg.pop("learn", None)
    eg["allow"] = allow
    doc[section] = eg
    return doc


def unified(old_text: str, new_text: str, old_name: str, new_name: str) -> str:
    """The unified diff `git apply` and `patch` read: a last line without its newline is followed
    by git's `\\ No newline at end of file` marker (difflib leaves the line unended)."""
    lines = difflib.unified_diff(
        _lines(old_text),
        _lines(new_text),
        fromfile=f"a/{old_name}",
        tofile=f"b/{new_name}",
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )


def _lines(text: str) -> list[str]:
    """`text` cut at its newlines only, as git cuts it (`splitlines` also cuts at U+2028 and
    other separators a JSON string may hold)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
