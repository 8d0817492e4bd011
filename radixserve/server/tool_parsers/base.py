"""What every tool-call format shares: the call types, the `ToolFormat` a family
declares, and the pieces its region reader is written with. The state machine that drives
the readers: parser.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.server.tool_parsers.json_stream import JsonStreamer

Reader = Generator[None, None, bool]
"""A format's region reader: yields for more text; returns False when the region broke."""
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class ToolCall:
    """One complete call found in a choice's output; `arguments` is a JSON object string."""

    index: int
    id: str
    name: str
    arguments: str

    def to_openai(self, streamed: bool = False) -> dict[str, Any]:
        """OpenAI's tool call; stream deltas also carry the call's index in the choice."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return {"index": self.index} | call if streamed else call


@dataclass
class ToolCallDelta:
    """A streamed piece of a call: the first carries its id and name, later ones only more
    `arguments` text (OpenAI's tool-call deltas)."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's `delta.tool_calls[]` item."""
        function: dict[str, Any] = {"arguments": self.arguments}
        head: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            head |= {"id": self.id, "type": "function"}
            function = {"name": self.name} | function
        return head | {"function": function}


@dataclass
class ParsedText:
    """What settled of a choice's output since the last feed: content text, the calls that
    completed, and the call deltas (fragments) in order."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    deltas: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class Source:
    """The text of one region, read by its reader from `pos`; `final`: no more will come."""

    text: str = ""
    pos: int = 0
    final: bool = False

    @property
    def rest(self) -> str:
        return self.text[self.pos :]

    def skip_space(self) -> None:
        rest = self.rest
        self.pos += len(rest) - len(rest.lstrip())


class CallSink(Protocol):
    """What a reader reports calls to; `ToolCallParser` is one."""

    def begin(self, name: str) -> bool:
        """Opens a call of tool `name`; False (nothing opened) if it is no known tool."""
        ...

    def arguments(self, text: str) -> None:
        """Appends to the open call's JSON arguments."""
        ...

    def schema(self, name: str) -> dict[str, Any]:
        """The parameters schema of tool `name` ({} when unknown)."""
        ...


@dataclass(frozen=True)
class ToolFormat:
    """One model family's tool-call output: where regions start and how one is read."""

    name: str
    markers: tuple[str, ...]
    """Texts that open a region anywhere in the output."""
    read: Callable[[Source, CallSink, str], Reader]
    """The region reader, given the marker that opened it ("" for a bare start)."""
    forced: Callable[[list[dict[str, Any]], str | None], tuple[str, Any]]
    """(SamplingParams' constraint kind, spec) forcing one call of the tools (or of the one
    named) in this format."""
    write_call: Callable[[str, dict[str, Any]], str]
    """One call (name, decoded arguments) as the model writes it: past calls in the prompt of
    a template that cannot render tools."""
    instruction: str
    """How to call, for that plain-text prompt (after the list of tools)."""
    bare_start: str = ""
    """Characters that open a region when they begin the output (after blanks)."""


# ---- pieces a reader is written with (each a generator: `yield from` it) -----------------


def literal(src: Source, text: str, skip_space: bool = True, consume: bool = True) -> Reader:
    """Whether `text` comes next (after blanks); consumed if so and `consume`."""
    while True:
        if skip_space:
            src.skip_space()
        rest = src.rest
        if rest.startswith(text):
            src.pos += len(text) if consume else 0
            return True
        if src.final or not text.startswith(rest):
            return False
        yield


def until(src: Source, end: str) -> Generator[None, None, str | None]:
    """The text up to `end` (consumed with it); None if `end` never comes."""
    while True:
        i = src.rest.find(end)
        if i >= 0:
            value = src.rest[:i]
            src.pos += i + len(end)
            return value
        if src.final:
            return None
        yield


def identifier(src: Source) -> Generator[None, None, str | None]:
    """A function or parameter name next (after blanks), or None."""
    while True:
        src.skip_space()
        match = IDENT.match(src.rest)
        if match is None and (src.rest or src.final):
            return None
        if match is not None and (match.end() < len(src.rest) or src.final):
            src.pos += match.end()
            return match.group()
        yield


def json_name(src: Source) -> Generator[None, None, str | None]:
    """A JSON string without escapes next (after blanks), as a name; or None."""
    while True:
        src.skip_space()
        match = re.match(r'"([^"\\\n]*)("?)', src.rest)
        if match is None and (src.rest or src.final):
            return None
        if match is not None and match.group(2):
            src.pos += match.end()
            return match.group(1)
        if src.final:
            return None
        yield


def json_arguments(src: Source, sink: CallSink) -> Reader:
    """Streams the JSON object that comes next as the open call's arguments; on a break,
    closes what was sent. True when the object ended."""
    streamer = JsonStreamer(object_only=True)
    while True:
        src.pos += streamer.feed(src.rest, src.final)
        sink.arguments(streamer.take())
        if streamer.done:
            return True
        if streamer.failed or src.final:
            sink.arguments(streamer.closers())
            return False
        yield


def begin_json_call(src: Source, sink: CallSink, name: str) -> Reader:
    """Opens a call of `name` if a JSON object comes next, then streams it as arguments."""
    if not (yield from literal(src, "{", consume=False)) or not sink.begin(name):
        return False
    return (yield from json_arguments(src, sink))


def json_envelope(src: Source, sink: CallSink, argument_keys: tuple[str, ...]) -> Reader:
    """One call as a JSON object `{"name": NAME, KEY: {...}}` (KEY one of `argument_keys`;
    no KEY: no arguments), with an optional trailing `"id"` string (Mistral's)."""
    if not (yield from literal(src, "{")) or not (yield from literal(src, '"name"')):
        return False
    if not (yield from literal(src, ":")) or (name := (yield from json_name(src))) is None:
        return False
    if (yield from literal(src, "}")):
        if not sink.begin(name):
            return False
        sink.arguments("{}")
        return True
    if not (yield from literal(src, ",")) or (yield from json_name(src)) not in argument_keys:
        return False
    if not (yield from literal(src, ":")) or not (yield from begin_json_call(src, sink, name)):
        return False
    if (yield from literal(src, ",")):
        if (yield from json_name(src)) != "id" or not (yield from literal(src, ":")):
            return False
        if (yield from json_name(src)) is None:
            return False
    return (yield from literal(src, "}"))
