"""`<think>...</think>` formats: DeepSeek-R1 (the chat template opens `<think>`, so the output
starts inside the reasoning; R1-0528 writes the tag again) and Qwen3 (the output opens it; an
output that does not start with it, e.g. with `enable_thinking: false`, is all content).

    output: [blanks] [<think>] reasoning </think> [blanks] content
             ^ opened by the template (deepseek-r1) or required here (qwen3)

Reasoning loses its surrounding blanks and content its leading ones, streamed or not: a
blank tail of reasoning is held until more reasoning follows it. An output that ends inside
the reasoning (no end marker: cut by max_tokens) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.reasoning.base import ReasoningSplit, partial_marker_len


@dataclass(frozen=True)
class ThinkFormat:
    """A `<think>`-style format: its markers and whether the prompt already opened it."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    opened_by_template: bool = False

    @property
    def grammar_start(self) -> str:
        """The text after which an output constraint applies."""
        return self.end

    def parser(self, opened: bool | None = None, stream_reasoning: bool = True) -> ThinkParser:
        return ThinkParser(self, self.opened_by_template if opened is None else opened,
                           stream_reasoning)  # fmt: skip


DEEPSEEK_R1 = ThinkFormat("deepseek-r1", opened_by_template=True)
QWEN3 = ThinkFormat("qwen3")


class ThinkParser:
    """The streaming parser of a `ThinkFormat` (see the module doc). `opened`: the reasoning
    is open at the start of the output. Without `stream_reasoning` the reasoning is held and
    sent whole when it ends."""

    def __init__(self, fmt: ThinkFormat, opened: bool, stream_reasoning: bool = True):
        self.fmt = fmt
        self.opened = opened
        self.stream_reasoning = stream_reasoning
        self.phase = "start"  # start -> reasoning -> content
        self.buffer = ""
        self.held_reasoning = ""  # not streamed yet: blanks, or all of it without streaming
        self.sent_reasoning = False  # leading blanks of the reasoning are dropped until then
        self.content_started = False  # leading blanks of the content are dropped until then

    @property
    def reasoning_ended(self) -> bool:
        return self.phase == "content"

    def feed(self, text: str, final: bool = False) -> ReasoningSplit:
        self.buffer += text
        out = ReasoningSplit()
        if self.phase == "start":
            self._read_start(final)
        if self.phase == "reasoning":
            self._read_reasoning(out, final)
        if self.phase == "content":
            out.content += self._take_content()
        return out

    def _read_start(self, final: bool) -> None:
        """Reads past an opening tag (optional when the template opened the reasoning)."""
        stripped = self.buffer.lstrip()
        start = self.fmt.start
        if not final and (not stripped or (start.startswith(stripped) and stripped != start)):
            return  # may still become the opening tag
        if stripped.startswith(start):
            self.buffer = stripped[len(start) :]
            self.phase = "reasoning"
        else:
            self.phase = "reasoning" if self.opened else "content"

    def _read_reasoning(self, out: ReasoningSplit, final: bool) -> None:
        end = self.buffer.find(self.fmt.end)
        if end >= 0:
            self._add_reasoning(self.buffer[:end], ending=True)
            self.buffer = self.buffer[end + len(self.fmt.end) :]
            self.phase = "content"
        else:
            keep = 0 if final else partial_marker_len(self.buffer, (self.fmt.end,))
            self._add_reasoning(self.buffer[: len(self.buffer) - keep], ending=final)
            self.buffer = self.buffer[len(self.buffer) - keep :]
        out.reasoning += self._release_reasoning(ending=self.phase == "content" or final)

    def _add_reasoning(self, text: str, ending: bool) -> None:
        if not self.sent_reasoning and not self.held_reasoning:
            text = text.lstrip()
        held = self.held_reasoning + text
        self.held_reasoning = held.rstrip() if ending else held

    def _release_reasoning(self, ending: bool) -> str:
        """The held reasoning that has settled: all when it ends, else up to a blank tail."""
        held = self.held_reasoning
        if not ending and not self.stream_reasoning:
            return ""
        ready = held if ending else held.rstrip()
        self.held_reasoning = held[len(ready) :]
        self.sent_reasoning = self.sent_reasoning or bool(ready)
        return ready

    def _take_content(self) -> str:
        text, self.buffer = self.buffer, ""
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        return text
