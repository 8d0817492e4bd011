"""`ToolCallParser`: one choice's output split into content and tool calls as it streams.

    output:  content ... MARKER <region: one or more calls> content ... MARKER ...
             (or a region at the very start, for formats whose calls may stand bare)

`ToolCallParser.feed` scans for a format's start marker, holding a tail that may begin
one. From a marker on, the format's reader (a generator over a `Source`: it yields when it
needs more text) reads the region. A reader reports a call by `begin(name)` only once the
name is a known tool and its arguments begin, then streams the arguments as JSON fragments
(`arguments`); concatenated they are the call's complete JSON object. A region whose reader
fails before any call began is content (its marker too), scanned again for markers; one
that breaks after a call began ends that call (its arguments closed into valid JSON) and
the text from the break on is read again as content. The result depends only on the text,
never on how it was cut into pieces.

Whole outputs (`streaming=False`: nothing is sent before the end) are judged by whole
regions instead: one that breaks is content, calls and all, and a bare call must be all of
the output. Both modes agree on every output whose calls are well formed.
"""

from __future__ import annotations

import uuid
from typing import Any

from radixserve.server.tool_parsers.base import (
    ParsedText,
    Reader,
    Source,
    ToolCall,
    ToolCallDelta,
    ToolFormat,
)
from radixserve.server.tool_parsers.registry import DEFAULT_TOOL_PARSER, tool_format


class ToolCallParser:
    """Splits one choice's output into content and calls to the tools `names`, in the
    format `tool_parser` names (or is), as the text arrives. `feed` returns what has settled;
    text that may still turn into a call is held. `schemas` (tool name -> parameters) types
    the values of formats that write them untyped (qwen3_coder). With `streaming=False` the
    text is held to the end and judged whole (see the module doc)."""

    def __init__(
        self,
        names: list[str],
        tool_parser: str | ToolFormat = DEFAULT_TOOL_PARSER,
        schemas: dict[str, Any] | None = None,
        streaming: bool = True,
    ):
        self.names = set(names)
        self.streaming = streaming
        self.fmt = tool_format(tool_parser) if isinstance(tool_parser, str) else tool_parser
        self.schemas = schemas or {}
        self.buffer = ""  # text not yet scanned
        self.region: Source | None = None
        self.reader: Reader | None = None
        self.region_head = ""  # the blanks and marker before the open region
        self.marker = ""  # the open region's marker ("": a bare region)
        self.started = 0  # calls the open region began
        self.kept = (0, 0, 0)  # len(out.calls), len(out.deltas), num_calls when it opened
        self.at_start = True  # nothing but blanks seen: a bare call may start here
        self.after_call = False  # leading whitespace of the next content is dropped
        self.num_calls = 0
        self.open: ToolCall | None = None  # the call being streamed (arguments so far)
        self.out = ParsedText()

    def feed(self, text: str, final: bool = False) -> ParsedText:
        """Parses `text`, the output's next piece; `final` when it is the last one."""
        self.buffer += text
        self.out = out = ParsedText()
        if not self.streaming and not final:
            return out
        while self._step(final):
            pass
        if final:
            self._finish_call()
        return out

    # ---- CallSink ----

    def begin(self, name: str) -> bool:
        if name not in self.names:
            return False
        self._finish_call()
        call_id = f"call_{uuid.uuid4().hex}"
        self.open = ToolCall(self.num_calls, call_id, name, "")
        self.num_calls += 1
        self.started += 1
        self.out.deltas.append(ToolCallDelta(self.open.index, call_id, name, ""))
        return True

    def arguments(self, text: str) -> None:
        if not text or self.open is None:
            return
        call = self.open
        self.open = ToolCall(call.index, call.id, call.name, call.arguments + text)
        last = self.out.deltas[-1] if self.out.deltas else None
        if last is not None and last.index == self.open.index:
            last.arguments += text
        else:
            self.out.deltas.append(ToolCallDelta(self.open.index, None, None, text))

    def schema(self, name: str) -> dict[str, Any]:
        return self.schemas.get(name) or {}

    # ---- scanning ----

    def _step(self, final: bool) -> bool:
        """Moves one piece of the buffer on; False when the rest must wait."""
        if self.reader is not None:
            return self._read_region(final)
        start = self._region_start()
        if start is not None:
            begin, marker = start
            before = self.buffer[:begin]
            self._add_content(before.rstrip())
            self.region_head = before[len(before.rstrip()) :] + marker
            self._open_region(self.buffer[begin + len(marker) :], marker)
            return True
        keep = 0 if final else self._held_tail()
        self._add_content(self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False

    def _region_start(self) -> tuple[int, str] | None:
        """Where the next region begins in the buffer, and its marker."""
        stripped = self.buffer.lstrip()
        if self.at_start and stripped and stripped[0] in self.fmt.bare_start:
            return len(self.buffer) - len(stripped), ""
        found = [(i, m) for m in self.fmt.markers if (i := self.buffer.find(m)) >= 0]
        return min(found) if found else None

    def _held_tail(self) -> int:
        """Trailing characters that may still begin a marker (a partial one, the blanks
        before it), or all of a blank output that may still open a bare call."""
        if self.at_start and self.fmt.bare_start and not self.buffer.strip():
            return len(self.buffer)
        text = self.buffer
        partial = 0
        for marker in self.fmt.markers:
            for k in range(min(len(text), len(marker) - 1), partial, -1):
                if marker.startswith(text[-k:]):
                    partial = k
                    break
        head = text[: len(text) - partial]
        return len(text) - len(head.rstrip())

    def _open_region(self, text: str, marker: str) -> None:
        self.region = Source(text)
        self.reader = self.fmt.read(self.region, self, marker)
        self.buffer, self.marker, self.started, self.at_start = "", marker, 0, False
        self.kept = (len(self.out.calls), len(self.out.deltas), self.num_calls)

    def _read_region(self, final: bool) -> bool:
        region = self.region
        region.text += self.buffer
        region.final, self.buffer = final, ""
        try:
            next(self.reader)
            return False  # waits for more text
        except StopIteration as stop:
            ended_well = bool(stop.value)
        self.reader = None
        if self.started and not self.streaming and not self._whole_region(ended_well):
            self._drop_region_calls()
        if self.started:
            self._finish_call()
            self.after_call = True
            self.buffer = region.rest
        else:  # not a call: the marker is content, the region's text is scanned again
            self._add_content(self.region_head)
            self.buffer = region.text
        return True

    def _whole_region(self, ended_well: bool) -> bool:
        """Whether a region judged whole holds calls: it ended well, and a bare one ended
        the output."""
        return ended_well and (self.marker or not self.region.rest.strip())

    def _drop_region_calls(self) -> None:
        num_out_calls, num_deltas, self.num_calls = self.kept
        del self.out.calls[num_out_calls:], self.out.deltas[num_deltas:]
        self.open, self.started = None, 0

    def _finish_call(self) -> None:
        if self.open is not None:
            self.out.calls.append(self.open)
            self.open = None

    def _add_content(self, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        if text.strip():
            self.at_start = False
        self.out.content += text
