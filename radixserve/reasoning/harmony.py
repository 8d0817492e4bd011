"""gpt-oss's harmony channels, read from the decoded text (special tokens kept):

    <|channel|>analysis<|message|> reasoning <|end|>
    <|start|>assistant<|channel|>final<|message|> content <|return|>

The prompt ends with `<|start|>assistant`, so the output begins with a message header. The
`analysis` channel is reasoning; every other channel's message body (`final`, `commentary`)
is content; headers and end tokens are dropped. Output that does not begin with a header is
all content. Two analysis messages are joined by a newline.

Why not `openai-harmony`: its encoding loads the o200k vocabulary file from the network on
first use (no offline copy ships with the wheel), and it parses harmony token ids, while the
server holds the model's own tokenizer's text; the markers are plain strings in that text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from radixserve.reasoning.base import ReasoningSplit, partial_marker_len

MESSAGE = "<|message|>"
END_MARKERS = ("<|end|>", "<|return|>", "<|call|>")
HEADER_MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>")
CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
REASONING_CHANNEL = "analysis"


@dataclass(frozen=True)
class HarmonyFormat:
    """gpt-oss: reasoning in the analysis channel, the answer in the final one."""

    name: str = "gpt-oss"
    grammar_start: str = "<|channel|>final<|message|>"
    """The text after which an output constraint applies: the final channel's body."""
    special_markers: bool = True
    """Its markers are special tokens: the text must be decoded with them kept."""

    def parser(self, opened: bool | None = None, stream_reasoning: bool = True) -> HarmonyParser:
        return HarmonyParser(stream_reasoning)


GPT_OSS = HarmonyFormat()


class HarmonyParser:
    """The streaming parser of harmony output (see the module doc)."""

    def __init__(self, stream_reasoning: bool = True):
        self.stream_reasoning = stream_reasoning
        self.phase = "header"  # header -> body -> header ...; or raw: plain content
        self.channel = ""
        self.buffer = ""
        self.held_reasoning = ""  # reasoning not sent yet (without stream_reasoning)
        self.num_reasoning_bodies = 0
        self.ended = False

    @property
    def reasoning_ended(self) -> bool:
        return self.ended

    def feed(self, text: str, final: bool = False) -> ReasoningSplit:
        self.buffer += text
        out = ReasoningSplit()
        while self._step(out, final):
            pass
        if final:
            self.ended = True
        out.reasoning += self._release(self.ended)
        return out

    def _step(self, out: ReasoningSplit, final: bool) -> bool:
        """Moves one piece of the buffer on; False when the rest must wait."""
        if self.phase == "raw":
            out.content += self.buffer
            self.buffer = ""
            return False
        if self.phase == "header":
            return self._read_header(final)
        return self._read_body(out, final)

    def _read_header(self, final: bool) -> bool:
        stripped = self.buffer.lstrip()
        if stripped and not stripped.startswith("<|") and not "<|".startswith(stripped):
            self.phase, self.ended = "raw", True  # not harmony: all content
            return True
        at = self.buffer.find(MESSAGE)
        if at < 0:
            if final:
                self.buffer = ""  # a header cut off by the end: nothing to show
            return False
        match = CHANNEL.search(self.buffer[:at])
        self.channel = match.group(1) if match else ""
        self.buffer = self.buffer[at + len(MESSAGE) :]
        self.phase = "body"
        if self.channel == REASONING_CHANNEL:
            self.num_reasoning_bodies += 1
            if self.num_reasoning_bodies > 1:
                self.held_reasoning += "\n"
        else:
            self.ended = True
        return True

    def _read_body(self, out: ReasoningSplit, final: bool) -> bool:
        found = [(i, m) for m in END_MARKERS if (i := self.buffer.find(m)) >= 0]
        if found:
            at, marker = min(found)
            self._add(out, self.buffer[:at])
            self.buffer = self.buffer[at + len(marker) :]
            self.phase = "header"
            return True
        keep = 0 if final else partial_marker_len(self.buffer, END_MARKERS + HEADER_MARKERS)
        self._add(out, self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False

    def _add(self, out: ReasoningSplit, text: str) -> None:
        if self.channel == REASONING_CHANNEL:
            self.held_reasoning += text
        else:
            out.content += text

    def _release(self, ending: bool) -> str:
        if not (self.stream_reasoning or ending):
            return ""
        text, self.held_reasoning = self.held_reasoning, ""
        return text
