"""`fila mcp`: fila's queue and review gate as Model Context Protocol tools (docs/mcp.md).

An agent (Claude Code, Codex, any MCP client) hands a task to a sandboxed engine and reads back
the reviewed diff. Every tool calls the one API (api/client.py), so a task submitted here is an
ordinary task of the queue (`fila ls`, `fila review` and the record show it), checked as a task
file is checked, with the client's name as its submitter.

Every argument is hostile input (docs/security.md): a submit names only what the tool schema has
(engine, prompt, targets, policy, check, fallback, command for the shell engine, and an id;
never a project, an image, limits or options), its policy must be one the operator allowed for
MCP, and the task then meets `fila submit`'s checks (targets inside the project and not denied,
the policy's limits and prompt cap, the task's size). Task ids are checked before any path is
made of them, and the server answers for its one root (or its one queue database) only. apply and
reject exist only when the operator started the server with `--allow-decide`: by default a
person decides. Every string returned (a diff, a log, a record's message, a prompt, a name) has
its control characters escaped, and is capped.
"""

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext

# The SDK reads each tool's annotations at registration: Context must be a module name here.
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_REQUEST, CallToolResult, TextContent
from pydantic import Field

from ..api.client import PENDING, Client, applied_json, decision_json, record_json
from ..core.errors import FilaError, Refused, UnknownPolicy
from ..core.models import Record
from ..workspace.fswalk import inert
from .limits import WAITS_PER_SESSION, Live, Waits

# What a tool returns of text an engine wrote: the end of a log, the start of a diff.
MAX_TEXT_BYTES = 256 * 1024
# Any other string a tool returns (a message, a prompt, a name): a record's fields are short, and
# what is longer is not what an agent reads the record for.
MAX_FIELD_CHARS = 16 * 1024
# The longest one wait tool call blocks: MCP clients time a call out (often after a minute or a
# few); an agent calls wait again.
MAX_WAIT_S = 300.0
# How often a wait reads the record (a file, or one query of the queue database).
WAIT_POLL_S = 0.25
# Tasks this server submitted that may be queued or running at once: each copies up to 1 MiB of
# the project and takes a worker's turn.
MAX_LIVE_TASKS = 20
MCP_PREFIX = "mcp:"
# The submitter's name: the client's own name (from its initialize), reduced to these characters.
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")

T = TypeVar("T")


# The policies MCP clients may name unless the operator lists others: `default` only (its route
# reaches no model provider with the operator's credentials).
DEFAULT_POLICIES = frozenset({"default"})


@dataclass(frozen=True)
class Settings:
    """What the operator chose when starting `fila mcp`; no tool call changes it."""

    policies: frozenset[str]
    allow_decide: bool = False
    decide_any: bool = False  # also tasks not submitted through MCP (a person's)
    max_live: int = MAX_LIVE_TASKS
    name: str = "fila"


def submitter(ctx: Context[Any, Any] | None) -> str:
    """`mcp:<client name>` from the client's initialize (safe characters only, capped), else
    `mcp:unknown`: a label for people, never a proof of who called."""
    name = None
    try:
        params = ctx.session.client_params if ctx is not None else None
        name = params.client_info.name if params is not None else None
    except (AttributeError, LookupError, ValueError):
        name = None
    cleaned = _NAME_CHARS.sub("_", name or "").strip()[:64]
    return f"{MCP_PREFIX}{cleaned or 'unknown'}"


def connection(rctx: ServerRequestContext[Any, Any]) -> str:
    """Which client connection a request came on: over HTTP its `Mcp-Session-Id` (the SDK's
    session, made at its initialize), over stdio the one client that started the server."""
    headers = getattr(rctx.request, "headers", None)
    return f"http:{headers.get('mcp-session-id', '')}" if headers is not None else "stdio"


def shown(data: bytes, *, tail: bool = False) -> tuple[str, bool]:
    """Bytes an engine wrote as text for an agent: at most MAX_TEXT_BYTES (the start, or with
    `tail` the end), invalid UTF-8 replaced, control characters escaped line by line (tabs and
    newlines kept). Returns the text and whether it was cut."""
    cut = len(data) > MAX_TEXT_BYTES
    if cut:
        data = data[-MAX_TEXT_BYTES:] if tail else data[:MAX_TEXT_BYTES]
    return inert_lines(data.decode("utf-8", errors="replace")), cut


def inert_lines(text: str) -> str:
    return "\n".join(inert(line) for line in text.split("\n"))


def relative(text: str, root: Path | None) -> str:
    """`text` with the root's absolute path (as given and as its realpath) written relative to the
    root (`fila/out`, `.` for the root itself): an agent learns nothing of the host's layout."""
    if root is None:
        return text
    for p in sorted({str(root), os.path.realpath(root)}, key=len, reverse=True):
        if p in text:
            text = re.sub(re.escape(p) + r"(/|(?![\w.-]))", lambda m: "" if m.group(1) else ".", text)
    return text


def safe(value: Any, root: Path | None = None) -> Any:
    """A structure for an agent (a record, a comparison, a decision): every string in it, keys
    too, capped at MAX_FIELD_CHARS and with control and format characters escaped (newlines and
    tabs kept), whoever wrote it (an engine's message, a prompt, a file's name); paths under
    `root` relative to it."""
    if isinstance(value, str):
        value = relative(value, root)
        if len(value) > MAX_FIELD_CHARS:
            value = value[:MAX_FIELD_CHARS] + f"... (cut: {len(value)} characters, at most {MAX_FIELD_CHARS})"
        return inert_lines(value)
    if isinstance(value, dict):
        return {safe(k, root): safe(v, root) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [safe(v, root) for v in value]
    return value


def kept(reason: str | None) -> str | None:
    """A decision's reason as the record keeps it: an agent's words, control characters escaped."""
    return inert_lines(reason) if reason is not None else None


def tool_error(e: FilaError, root: Path | None = None) -> ToolError:
    """What the client sees of a refusal: the CLI's own message and hint, marked as an error
    (paths under `root` relative to it)."""
    text = f"fila: error: {inert(str(e))}" + (f"\nfila: hint: {inert(e.hint)}" if e.hint else "")
    return ToolError(relative(text, root))


def plain_validation(tool: str, text: str) -> str | None:
    """The SDK's pydantic dump of a call's bad arguments as fila words (`argument 'task_id':
    String should have at most 128 characters`), without the input echoed or a URL; None when
    `text` is no such dump."""
    head, _, body = text.partition("\n")
    if not re.fullmatch(r"(Error executing tool \S+: )?\d+ validation errors? for \w+Arguments", head):
        return None
    said, loc = [], None
    for line in body.split("\n"):
        if not line.startswith(" "):
            loc = line
        elif not line.startswith("    ") and loc is not None:
            msg = line.strip().split(" [type=", 1)[0]
            said.append(f"argument {inert(loc)!r}: {inert(msg)}")
    return f"Error executing tool {tool}: fila: error: {'; '.join(said) or 'invalid arguments'}"


class Tools:
    """The tools' bodies over one client: plain methods (testable without a transport), each
    FilaError turned into a tool error with the CLI's words."""

    def __init__(self, client: Client, settings: Settings) -> None:
        self.client, self.settings = client, settings
        self.waits = Waits()
        self.root = client.root.path
        self.live = Live(client, settings.max_live)

    def safe(self, value: Any) -> Any:
        return safe(value, self.root)

    def call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except FilaError as e:
            raise tool_error(e, self.root) from None

    def check_policy(self, policy: str) -> None:
        allowed = sorted(self.settings.policies)
        if policy not in self.settings.policies:
            raise UnknownPolicy(
                f"policy {policy!r} is not allowed for MCP (allowed: {', '.join(allowed) or 'none'})",
                hint="ask the operator to start `fila mcp` with --policy NAME",
            )

    def submit(self, who: str, *, engine: str, targets: list[str], prompt: str = "", policy: str = "default",
               check: str | None = None, fallback: list[str] | None = None, command: str | None = None,
               task_id: str | None = None) -> dict[str, Any]:  # fmt: skip
        def go() -> dict[str, Any]:
            self.check_policy(policy)
            with self.live.slot() as submitted:
                rec = self.client.submit(
                    {"engine": engine, "targets": targets, "prompt": prompt, "policy": policy},
                    source="the MCP submit",
                    check=check,
                    fallback=fallback,
                    command=command,
                    id=task_id,
                    submitter=who,
                )
                submitted(rec.id)
            return {"id": rec.id, "status": rec.status.value, "submitter": who}

        return self.call(go)

    async def wait(self, session: str, task_id: str, timeout_s: float) -> dict[str, Any]:
        """Poll the record until it settles or `timeout_s` (capped) passes: asynchronous, so a
        waiting client holds no thread and its cancellation ends it (mcp/limits.py)."""
        timeout = min(max(timeout_s, 0.0), MAX_WAIT_S)
        try:
            with self.waits.slot(session):
                deadline = anyio.current_time() + timeout
                while True:
                    rec = await anyio.to_thread.run_sync(self.client.record, task_id,
                                                         limiter=self.waits.readers)  # fmt: skip
                    if rec.status not in PENDING:
                        return self.safe(
                            {"id": rec.id, "status": rec.status.value, "settled": True, **brief(rec)}
                        )
                    left = deadline - anyio.current_time()
                    if left <= 0:
                        return {"id": rec.id, "status": rec.status.value, "settled": False,
                                "note": f"task {rec.id} is still {rec.status} after {timeout:g} s: wait "
                                "again, the task goes on without the wait"}  # fmt: skip
                    await anyio.sleep(min(WAIT_POLL_S, left))
        except FilaError as e:
            raise tool_error(e, self.root) from None

    def status(self, task_id: str) -> dict[str, Any]:
        return self.call(lambda: self.safe(record_json(self.client.record(task_id))))

    def review(self, task_id: str) -> dict[str, Any]:
        def go() -> dict[str, Any]:
            from ..review.report import summary_lines, to_json

            rv = self.client.review(task_id)
            doc = to_json(rv)
            diff, cut = shown(rv.data) if rv.data is not None else ("", False)
            return {
                "diff": diff,
                "diff_truncated": cut,
                **self.safe({
                    "id": doc["id"],
                    "status": doc["status"],
                    "summary": "\n".join(summary_lines(rv)),
                    "warnings": rv.warnings,
                    "verified": doc["verified"],
                    "patch_sha256": doc["patch_sha256"],
                    "files": doc["files"],
                }),
            }  # fmt: skip

        return self.call(go)

    def log(self, task_id: str, events: bool) -> dict[str, Any]:
        def go() -> dict[str, Any]:
            text, cut = shown(self.client.log(task_id, events=events), tail=True)
            return {"id": task_id, "log": text, "truncated": cut}

        return self.call(go)

    def compare(self, group: str) -> dict[str, Any]:
        return self.call(lambda: self.safe(self.client.compare_json(group)))

    def decidable(self, task_id: str) -> None:
        """A task an MCP client may decide: one submitted through MCP, or with `decide_any` any."""
        if self.settings.decide_any:
            return
        rec = self.client.record(task_id)
        by = rec.task.submitter if rec.task is not None else None
        if not (by or "").startswith(MCP_PREFIX):
            raise Refused(
                f"task {task_id} was not submitted through MCP (submitter {by or 'unknown'}): "
                "a person decides it",
                hint="`fila review` and `fila apply` it, or start `fila mcp` with --decide-any",
            )

    def apply(self, who: str, task_id: str, reason: str | None) -> dict[str, Any]:
        def go() -> dict[str, Any]:
            self.decidable(task_id)
            return self.safe(applied_json(task_id, self.client.apply(task_id, by=who, reason=kept(reason))))

        return self.call(go)

    def reject(self, who: str, task_id: str, reason: str | None) -> dict[str, Any]:
        def go() -> dict[str, Any]:
            self.decidable(task_id)
            return self.safe(decision_json(task_id, self.client.reject(task_id, by=who, reason=kept(reason))))

        return self.call(go)


def brief(rec: Record) -> dict[str, Any]:
    """What an agent reads first of a settled record: the diff's size, the error, the check."""
    st = rec.diffstat
    return {
        "diffstat": st.model_dump(mode="json") if st else None,
        "error": {"kind": rec.error.kind, "message": rec.error.message} if rec.error else None,
        "check": rec.check.model_dump(mode="json") if rec.check else None,
        "warnings": rec.warnings,
    }


TaskId = Annotated[str, Field(min_length=1, max_length=128, description="a task id (from submit)")]
Reason = Annotated[str | None, Field(default=None, max_length=4000, description="why (recorded)")]


Targets = Annotated[list[str], Field(min_length=1, max_length=256, description="paths in the project")]
Engines = Annotated[list[str] | None, Field(max_length=16, description="engines tried on quota")]
Text = Annotated[str | None, Field(description="a command (recorded)")]
NewId = Annotated[
    str | None,
    Field(
        max_length=128,
        description="an id of your choosing (letters, digits, . _ -; default generated): a submit "
        "retried with the same id is refused as a duplicate, never queued twice",
    ),
]
Seconds = Annotated[float, Field(ge=0, le=MAX_WAIT_S, description="at most this long")]
INSTRUCTIONS = (
    "fila runs a coding engine on a copy of this project in a throwaway sandbox and stops at a diff: "
    "submit a task, wait for it, then read its review (summary, warnings, diff). Nothing lands in the "
    "project until it is applied"
)
SUBMIT = (
    "Queue a task: an engine works on copies of `targets` (paths relative to the project) in a "
    "sandbox under `policy` (allowed: {allowed}); the shell engine runs `command`. Returns its id; "
    "a worker runs it: then call wait, and review."
)
WAIT = (
    "Wait until the task is settled (ready for review, failed, decided), at most timeout_s seconds "
    f"(capped at {MAX_WAIT_S:g}); settled false: call it again. At most "
    f"{WAITS_PER_SESSION} waits of a client at once."
)
REVIEW = (
    "What a decision is about: a summary, the warnings, the files and the diff (checked against the "
    "sha256 its record names)."
)
APPLY = (
    "Apply the task's reviewed diff to the project (or nothing) and record the decision; refused "
    "when the project moved, the diff changed, or it was decided already."
)


async def initialize_once(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
    """Middleware: a connection's client is named at its first initialize; a second one (which
    would rename the submitter and decider mid-session) is refused."""
    if ctx.method == "initialize" and ctx.session.client_params is not None:
        raise MCPError(code=INVALID_REQUEST, message="initialized already: a client's name is fixed at its "
                       "first initialize (reconnect to start again)")  # fmt: skip
    return await call_next(ctx)


class KnownArguments:
    """Middleware: a tool call naming an argument its tool does not take (a `project`, an
    `image`, `limits`) is refused whole, never run with the argument dropped in silence; the SDK's
    dump of arguments that do not validate is answered in fila's words (plain_validation)."""

    def __init__(self) -> None:
        self.server: MCPServer | None = None
        self.known: dict[str, set[str]] | None = None

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        params = ctx.params if isinstance(ctx.params, dict) else {}
        args = params.get("arguments")
        if ctx.method == "tools/call" and isinstance(args, dict) and self.server is not None:
            if self.known is None:
                tools = await self.server.list_tools()
                self.known = {t.name: set(t.input_schema.get("properties", {})) for t in tools}
            takes = self.known.get(str(params.get("name")))
            stray = sorted(set(args) - takes) if takes is not None else []
            if stray:
                text = (f"fila: error: tool {params.get('name')!r} takes no argument {inert(stray[0])!r} "
                        f"(it takes: {', '.join(sorted(takes or ()))})")  # fmt: skip
                return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)
        res = await call_next(ctx)
        if ctx.method == "tools/call" and isinstance(res, dict) and res.get("isError"):
            content = res.get("content")
            first = content[0] if isinstance(content, list) and content else None
            if isinstance(first, dict) and isinstance(first.get("text"), str):
                first["text"] = plain_validation(str(params.get("name")), first["text"]) or first["text"]
        return res


def build(client: Client, settings: Settings) -> MCPServer:
    """The server and its tools; apply and reject only with `settings.allow_decide`."""
    tools = Tools(client, settings)
    allowed = ", ".join(sorted(settings.policies)) or "none"
    decides = " (the apply tool)." if settings.allow_decide else " by a person."
    from importlib.metadata import version

    known = KnownArguments()
    server: MCPServer = MCPServer(settings.name, instructions=INSTRUCTIONS + decides, version=version("fila"),
                                  log_level="WARNING", middleware=[initialize_once, known])  # fmt: skip
    known.server = server

    @server.tool(description=SUBMIT.format(allowed=allowed))
    def submit(
        engine: Annotated[str, Field(max_length=64, description="engine: shell, claude, codex, ...")],
        targets: Targets,
        ctx: Context,
        prompt: Annotated[str, Field(description="what the engine is asked to do")] = "",
        policy: Annotated[str, Field(max_length=128, description=f"one of {allowed}")] = "default",
        check: Text = None,
        fallback: Engines = None,
        command: Text = None,
        task_id: NewId = None,
    ) -> dict[str, Any]:
        return tools.submit(submitter(ctx), engine=engine, targets=targets, prompt=prompt, policy=policy,
                            check=check, fallback=fallback, command=command, task_id=task_id)  # fmt: skip

    @server.tool(description=WAIT)
    async def wait(task_id: TaskId, ctx: Context, timeout_s: Seconds = 60.0) -> dict[str, Any]:
        return await tools.wait(connection(ctx.request_context), task_id, timeout_s)

    @server.tool(description="The task's record: status, engine, policy, timings, diffstat, error, decision.")
    def status(task_id: TaskId) -> dict[str, Any]:
        return tools.status(task_id)

    @server.tool(description=REVIEW)
    def review(task_id: TaskId) -> dict[str, Any]:
        return tools.review(task_id)

    @server.tool(description="The engine's output (its end), or with events the task's event log.")
    def log(task_id: TaskId, events: bool = False) -> dict[str, Any]:
        return tools.log(task_id, events)

    @server.tool(description="A compare group's tasks side by side: status, files, +/- lines, time, check.")
    def compare(group: TaskId) -> dict[str, Any]:
        return tools.compare(group)

    if settings.allow_decide:

        @server.tool(description=APPLY)
        def apply(task_id: TaskId, ctx: Context, reason: Reason = None) -> dict[str, Any]:
            return tools.apply(submitter(ctx), task_id, reason)

        @server.tool(description="Reject the task and record why; the project is not touched.")
        def reject(task_id: TaskId, ctx: Context, reason: Reason = None) -> dict[str, Any]:
            return tools.reject(submitter(ctx), task_id, reason)

    return server
