"""What every reasoning format shares: the split of an output (`ReasoningSplit`), the streaming
parser's interface, and the held tail of a marker cut across chunks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class ReasoningSplit:
    """An output's (or one delta's) reasoning and the content after it."""

    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: ReasoningSplit) -> ReasoningSplit:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class StreamingReasoningParser(Protocol):
    """Fed an output's pieces in order, returns what settled in each: reasoning and content
    deltas. The deltas add up to `split_reasoning` of the whole text, however it was cut."""

    def feed(self, text: str, final: bool = False) -> ReasoningSplit: ...

    @property
    def reasoning_ended(self) -> bool:
        """Whether the reasoning is over (its end marker seen, or it never began)."""
        ...


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that begins one of `markers` (0: none)."""
    longest = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-k:]):
                longest = k
                break
    return longest
