"""What a project's Dockerfile may name (docs/environments.md, "A project Dockerfile"): read before
it is built, because the build's network (none, or its gateway's) binds only its RUN steps. The
daemon itself fetches an `ADD` URL or git source and pulls a `FROM` image it lacks, and `COPY
--from` reads any local image (an environment of another project). So: no remote source, and every
image the build starts from or copies from is one of its own stages or a local image the policy's
`images` allow (checked by the caller, env/build.resolve_base), named without a variable.

The parser follows the classic builder's reading: lines end at \\n only (a control character
Python would break at elsewhere is refused), parser directives first (an `escape` one is
refused: fila reads only the default `\\`), a line ending in the escape character continues, a
comment line (also inside a continuation) and an empty line are dropped, instructions are
case-insensitive, their flags (`--from=`) come first. An instruction fila does not know is refused,
and so is an image reference or an ADD source holding what the builder's word processing would
undo (quotes, escapes, variables): a Dockerfile fila reads differently from the daemon fails closed.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InvalidEnvironment, InvalidInput
from ..core.models import Policy
from ..core.text import escape_name
from ..queue.policy import image_allowed
from ..sandbox.base import Backend, ImageInfo
from ..workspace import fswalk
from ..workspace.fswalk import Entry
from .key import portable_mode

MAX_DOCKERFILE_BYTES = 1 << 20

KNOWN = frozenset(
    {"FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
     "USER", "WORKDIR", "ARG", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
)  # fmt: skip
_DIRECTIVE = re.compile(r"\s*#\s*([A-Za-z]+)\s*=\s*(.*?)\s*$")
_CONTINUED = re.compile(r"\\[ \t]*$")
# The flags fila reads, on the instructions that take them (RUN's are BuildKit's: none); their
# values plain (a user, a stage, an image reference).
_FLAGS = {
    "COPY": frozenset({"from", "chown"}),
    "ADD": frozenset({"chown"}),
    "HEALTHCHECK": frozenset({"interval", "timeout", "start-period", "retries"}),
}
_FLAG_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,255}")
_STAGE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_REMOTE = re.compile(r"^([a-z][a-z0-9+.-]*://|git@)", re.IGNORECASE)


@dataclass(frozen=True)
class Instruction:
    line: int  # where it starts (1-based)
    keyword: str  # upper case
    flags: dict[str, str]
    args: list[str]  # the JSON form's items, or the shell form's words
    body: str = ""  # the text after the flags, as written (joined from its continuation lines)
    json_form: bool = False


# What Python's str.splitlines breaks at besides \n and \r, and the other control characters: the
# classic builder breaks lines at \n only, so a Dockerfile holding one is read two ways (refused).
_UNREAD = re.compile("[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f\x85\u2028\u2029]")
# Characters the builder's word processing consumes in ADD, COPY --from and FROM arguments (quotes,
# escapes, variables): an argument holding one means something else to the daemon than as written.
_REWRITTEN = re.compile(r"[\"'\\$`]")


def parse(text: str) -> list[Instruction]:
    """The Dockerfile's instructions as the classic builder reads them. Raises InvalidEnvironment
    on a control character (the builder and Python break lines differently at some), an escape
    directive or an unknown instruction."""
    bad = _UNREAD.search(text)
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        raise InvalidEnvironment(
            f"the Dockerfile's line {line} holds the control character U+{ord(bad.group()):04X}",
            hint="a Dockerfile is text: lines end with \\n (a \\r before it is taken), tabs are kept",
        )
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    for n, raw in enumerate(lines, 1):
        if "\r" in raw:
            raise InvalidEnvironment(f"the Dockerfile's line {n} holds a carriage return not before its end")
    for raw in lines:
        m = _DIRECTIVE.match(raw)
        if m is None:
            break
        if m.group(1).lower() == "escape":
            raise InvalidEnvironment(
                "the Dockerfile's `escape` directive is refused: fila reads the default escape (\\)"
            )
    out: list[Instruction] = []
    cur: str | None = None
    start = 0
    for n, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # a comment or an empty line, also inside a continuation
        if cur is None:
            cur, start = "", n
        # The builder's rule: the escape character, then only spaces and tabs, continues a line.
        cont = _CONTINUED.search(raw)
        if cont is not None:
            cur += raw[: cont.start()]
            continue
        out.append(_instruction(start, cur + raw))
        cur = None
    if cur is not None and cur.strip():
        out.append(_instruction(start, cur))
    return out


def _instruction(line: int, text: str) -> Instruction:
    keyword, _, rest = text.strip(" \t").partition(" ")
    keyword = keyword.upper()
    if keyword not in KNOWN:
        raise InvalidEnvironment(
            f"the Dockerfile's line {line}: instruction {escape_name(keyword)[:40]!r} is not one fila reads",
            hint="the build is the classic builder's: FROM, RUN, COPY, ADD, ENV, ARG, ... (no ONBUILD)",
        )
    flags: dict[str, str] = {}
    body = rest.lstrip(" \t")
    while body.startswith("--"):
        word, _, body = body.partition(" ")
        name, _, value = word[2:].partition("=")
        flags[name.lower()] = value
        body = body.lstrip(" \t")
    args = body.split()
    json_form = False
    if body.startswith("["):
        # The builder decodes one JSON value and ignores what follows it: fila takes the JSON form
        # only when it is the whole text, and refuses a text that starts like one and is not.
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not (isinstance(parsed, list) and all(isinstance(a, str) for a in parsed)):
            raise InvalidEnvironment(
                f"the Dockerfile's line {line} ({keyword}): a [ starts a JSON array of strings that is "
                "not the whole of its arguments"
            )
        args, json_form = parsed, True
    return Instruction(line, keyword, flags, args, body, json_form)


def references(text: str) -> list[tuple[int, str]]:
    """The images the build starts from or copies from that are not its own stages: (line, ref).
    Raises InvalidEnvironment for a remote ADD source, a variable in an image reference, a stage
    index not yet defined, or a RUN flag (the classic builder has none; BuildKit's `--mount=from`
    and `--network` would reach past the build's bounds)."""
    stages: list[str] = []
    refs: list[tuple[int, str]] = []

    def refuse(ins: Instruction, why: str) -> InvalidEnvironment:
        return InvalidEnvironment(
            f"the Dockerfile's line {ins.line} ({ins.keyword}): {why}",
            hint="FROM and --from name a stage of the Dockerfile or a local image the policy's `images` "
            "allow; what needs the network belongs to the setup commands",
        )

    def image(ins: Instruction, ref: str, *, index: bool = False) -> None:
        if _REWRITTEN.search(ref):
            why = "names its image with a variable, a quote or an escape"
            raise refuse(ins, f"{escape_name(ref)[:100]!r} {why}")
        # The builder knows a stage once it is finished: `--from` naming the stage it is in is an
        # image to it (a local one of that name, or a pull), so it is one to fila too.
        finished = stages[:-1] if index else stages
        if ref.lower() in finished or (ref.lower() == "scratch" and not index):
            return
        if index and re.fullmatch(r"[0-9]+", ref):
            if int(ref) >= len(finished):
                raise refuse(ins, f"stage {ref} is not finished above")
            return
        refs.append((ins.line, ref))

    for ins in parse(text):
        allowed = _FLAGS.get(ins.keyword, frozenset())
        for flag, value in ins.flags.items():
            if flag not in allowed:
                raise refuse(ins, f"flag --{escape_name(flag)[:40]} is not one fila reads on {ins.keyword}")
            if not _FLAG_VALUE.fullmatch(value):
                raise refuse(ins, f"--{flag}={escape_name(value)[:100]!r} is not plain: written with a "
                                  "variable, a quote or an escape, or empty")  # fmt: skip
        if ins.keyword == "FROM":
            if not ins.args or len(ins.args) not in (1, 3) or ins.json_form:
                raise refuse(ins, "FROM takes an image, and AS and a stage name")
            image(ins, ins.args[0])
            name = ins.args[2].lower() if len(ins.args) == 3 else ""
            if len(ins.args) == 3 and (ins.args[1].upper() != "AS" or not _STAGE.fullmatch(name)):
                raise refuse(ins, f"stage {escape_name(ins.args[-1])[:60]!r} is not a stage name")
            stages.append(name)
        elif ins.keyword == "VOLUME":
            # An anonymous volume's writes are no layer's: the build's size is not measured there.
            raise refuse(
                ins, "VOLUME is refused in a project Dockerfile (what a step writes there is not measured)"
            )
        elif ins.keyword == "ADD":
            for src in ins.args[:-1] or ins.args:
                if _REMOTE.match(src) or "://" in src or _REWRITTEN.search(src):
                    raise refuse(ins, f"source {escape_name(src)[:100]!r} would be fetched by the daemon, "
                                      "past the build's network bounds")  # fmt: skip
            # The daemon also unpacks a local archive itself, outside the measured steps (a 39 KB
            # archive made a 270 MB image): COPY does what else ADD does.
            raise refuse(ins, "ADD is refused in a project Dockerfile: use COPY (and unpack an archive "
                              "in a RUN step, where what it writes is measured)")  # fmt: skip
        elif ins.keyword == "COPY":
            if len(ins.args) < 2:
                raise refuse(ins, "COPY takes sources and a destination")
            if "from" in ins.flags:
                image(ins, ins.flags["from"], index=True)
    return refs


def canonical(text: str) -> str:
    """The Dockerfile the daemon is given: what fila read (`references` checked it), one
    instruction a line, no parser directive, comment or continuation, FROM with the image it
    checked, COPY and ADD in the JSON form of the arguments it checked, the others as written. So
    the builder's reading cannot differ from fila's however the original was spelled (docs/
    environments.md, "A project Dockerfile")."""
    references(text)
    out = []
    for ins in parse(text):
        flags = "".join(f"--{k}={v} " for k, v in ins.flags.items())
        if ins.keyword == "FROM":
            line = "FROM " + " ".join(ins.args)
        elif ins.keyword == "COPY" or ins.json_form:
            line = f"{ins.keyword} {flags}{json.dumps(ins.args)}"
        else:
            line = f"{ins.keyword} {flags}{ins.body}".rstrip(" \t")
        if _CONTINUED.search(line):
            raise InvalidEnvironment(
                f"the Dockerfile's line {ins.line} ({ins.keyword}) ends with a backslash after its "
                "continuations"
            )
        out.append(line)
    return "\n".join(out) + "\n"


def decode(data: bytes) -> str:
    """A Dockerfile's text: UTF-8, strictly (a byte the builder would read as a space, 0xA0 or
    0x85 alone, is not text)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidEnvironment(f"the Dockerfile is not UTF-8 text (byte {e.start})") from None


def archive(context: Path, entries: list[Entry], dockerfile: bytes, dest: Path) -> str:
    """The build context as a tar at `dest`: exactly what the key took of `entries` (context_entries:
    what the deny rules leave; files and links with their portable modes, directories implied),
    read without following a link, and the Dockerfile (`dockerfile`: the bytes fila checked) as
    fila read it (`canonical`); returns the Dockerfile's name in it."""
    name = f".fila-dockerfile-{secrets.token_hex(8)}"  # no file of the project's
    with tarfile.open(dest, "w") as tar:
        for e in entries:
            info = tarfile.TarInfo(e.rel)
            info.mode = portable_mode(e)
            if e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(context / e.rel)
                tar.addfile(info)
            elif e.kind == "file":
                data = fswalk.read_file(context / e.rel, max_bytes=e.size)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        data = canonical(decode(dockerfile)).encode()
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    return name


# fila's own images that hold other projects' environments or its egress: never a project's base
# (a pattern like `fila/*` in the policy's images would admit them).
_INTERNAL = re.compile(r"^(?:docker\.io/)?fila/(?:env|env-[^/:@]*|gateway)(?:[:@].*)?$")


def local_image(policy: Policy, backend: Backend, ref: str, what: str) -> ImageInfo:
    """The local image `ref` names, when the policy's `images` allow it and it is not one of fila's
    internal images; never pulled. InvalidInput otherwise, naming `what` (where it was named)."""
    if _INTERNAL.match(ref) or not image_allowed(policy, ref):
        raise InvalidInput(
            f"image {escape_name(ref)[:200]!r} ({what}) is not allowed by the policy "
            f"(allowed: {', '.join(policy.images) or 'none'}; "
            "fila's environment and gateway images never are)",
            hint="add a pattern for it to the policy's `images`",
        )
    info = backend.image_info(ref)
    if info is None:
        raise InvalidInput(
            f"image {escape_name(ref)[:200]!r} ({what}) is not present in {backend.name}",
            hint=f"pull or build it first (`docker pull {ref}`): fila never pulls an environment's image",
        )
    if info.onbuild:
        # Its triggers would run in the builds FROM it (the base's, each engine's layer), where
        # an ADD of a URL is the daemon's own fetch.
        raise InvalidInput(
            f"image {escape_name(ref)[:200]!r} ({what}) has ONBUILD triggers: "
            "refused as an environment's base",
            hint="build an image without ONBUILD from it and name that one",
        )
    return info
