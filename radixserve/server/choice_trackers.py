"""Choice trackers: one request's cumulative result turned into the deltas every chat API
streams (OpenAI's completions and chat, Anthropic's Messages, the Responses API): new text,
logprobs, the finish, reasoning split off, tool calls read from the content."""

from __future__ import annotations

from typing import Any

from radixserve.client.result import RequestResult
from radixserve.reasoning import ReasoningFormat, StreamingReasoningParser
from radixserve.server.errors import BadRequest
from radixserve.server.openai_response import MIN_LOGPROB, Delta, TokenLogprob
from radixserve.server.reasoning import ReasoningOptions, choice_reasoning_parser
from radixserve.server.tool_calls import ToolCallParser, tool_names, tool_schemas


class ChoiceTracker:
    """Turns one request's cumulative result into OpenAI deltas: new text, logprobs, finish;
    with a `reasoning` parser, the text is split into reasoning and content."""

    def __init__(
        self,
        result: RequestResult,
        tokenizer,
        echo_text: str = "",
        reasoning: StreamingReasoningParser | None = None,
        tokens_as_ids: bool = False,
        echo_logprobs: bool | None = None,
    ):
        """`echo_logprobs`: the choice's logprobs start with its prompt's (completions' echo);
        by default when the request scores its prompt, but not for vLLM's prompt_logprobs,
        which are reported apart (openai_response.prompt_logprobs)."""
        self.result = result
        self.reasoning = reasoning
        self.tokenizer = tokenizer
        self.pending_text = echo_text  # sent with the first delta
        if echo_logprobs is None:
            start = result.spec.logprob_start_len
            echo_logprobs = start is not None and start >= 0 and not result.spec.input_ranks
        self.echo_logprobs = echo_logprobs
        self.sent_text = ""
        self.num_sent_ids = 0
        self.num_sent_logprobs = 0
        self.text_offset = 0
        self.finished = False
        self.tokens_as_ids = tokens_as_ids  # logprob tokens as vLLM's "token_id:N"

    def next_delta(self) -> Delta | None:
        """What is new since the last call; None when nothing is."""
        if self.finished:
            return None
        text = self._new_text()
        logprobs = self._new_logprobs() if self.result.spec.wants_logprobs else []
        finish = finish_reason(self.result)
        self.finished = finish is not None
        reasoning = None
        if self.reasoning is not None:
            split = self.reasoning.feed(text, final=self.finished)
            text, reasoning = split.content, split.reasoning
        if not text and not reasoning and not logprobs and finish is None:
            return None
        return Delta(text, logprobs, finish, reasoning=reasoning)

    def take_token_ids(self) -> list[int]:
        """The output token ids not taken before (vLLM's per-chunk `token_ids`)."""
        ids = self.result.output_ids[self.num_sent_ids :]
        self.num_sent_ids += len(ids)
        return ids

    def _new_text(self) -> str:
        text = self.result.text()
        new = text[len(self.sent_text) :]
        if new:
            self.sent_text = text
        new, self.pending_text = self.pending_text + new, ""
        return new

    def _new_logprobs(self) -> list[TokenLogprob]:
        result = self.result
        inputs, input_tops = result.input_logprobs, result.input_top_logprobs
        if not self.echo_logprobs:  # scored for prompt_logprobs, reported apart
            inputs, input_tops = [], []
        elif not inputs and result.prompt_len == 1:
            # The core scores no position of a one-token prompt, not even the first (None).
            inputs, input_tops = [(None, result.spec.input_ids[0])], [None]
        values, tops = inputs + result.output_logprobs, input_tops + result.output_top_logprobs
        start, self.num_sent_logprobs = self.num_sent_logprobs, len(values)
        return [self._entry(v, t, top) for (v, t), top in zip(values[start:], tops[start:])]

    def _entry(self, value: float | None, token_id: int, top) -> TokenLogprob:
        text = self.tokenizer.decode([token_id])
        offset, self.text_offset = self.text_offset, self.text_offset + len(text)
        top = None if top is None else [(self._name(t), _floor(v)) for v, t in top]
        value = None if value is None else _floor(value)
        return TokenLogprob(self._name(token_id, text), value, top, offset)

    def _name(self, token_id: int, text: str | None = None) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id]) if text is None else text


class ToolCallTracker(ChoiceTracker):
    """A chat choice that may call tools, read by `parser` (or, given tool names, the
    default format's streaming parser): its deltas carry content, the calls completed and
    the call fragments streamed."""

    def __init__(
        self,
        result: RequestResult,
        tokenizer,
        parser: ToolCallParser | list[str],
        reasoning: StreamingReasoningParser | None = None,
        tokens_as_ids: bool = False,
        single_call: bool = False,
    ):
        super().__init__(result, tokenizer, reasoning=reasoning, tokens_as_ids=tokens_as_ids)
        self.parser = ToolCallParser(parser) if isinstance(parser, list) else parser
        self.single_call = single_call  # parallel_tool_calls false: calls after the first dropped

    def next_delta(self) -> Delta | None:
        delta = super().next_delta()
        if delta is None:
            return None
        parsed = self.parser.feed(delta.text, final=delta.finish_reason is not None)
        if self.single_call:
            parsed.calls = [call for call in parsed.calls if call.index == 0]
            parsed.deltas = [piece for piece in parsed.deltas if piece.index == 0]
        finish = delta.finish_reason
        if finish == "stop" and self.parser.num_calls:
            finish = "tool_calls"
        reasoning = delta.reasoning
        if not (parsed.content or parsed.calls or parsed.deltas or delta.logprobs or finish
                or reasoning):  # fmt: skip
            return None
        return Delta(parsed.content, delta.logprobs, finish, parsed.calls, parsed.deltas, reasoning)


def chat_tracker(
    result: RequestResult,
    tokenizer,
    reasoning_format: ReasoningFormat | None,
    reasoning: ReasoningOptions,
    tools: list[dict[str, Any]] | None,
    tool_parser: str,
    stream: bool,
    single_call: bool = False,
) -> ChoiceTracker:
    """One chat choice's reader, as the Messages, Responses and Ollama APIs make it: its
    reasoning split off first (with `--reasoning-parser`), then, with `tools` offered, its
    calls read from the content in `tool_parser`'s format; `single_call`: the first only
    (Responses' parallel_tool_calls false, Messages' disable_parallel_tool_use)."""
    reader = choice_reasoning_parser(reasoning_format, reasoning)
    if not tools:
        return ChoiceTracker(result, tokenizer, reasoning=reader)
    parser = ToolCallParser(tool_names(tools), tool_parser, tool_schemas(tools), stream)
    return ToolCallTracker(result, tokenizer, parser, reader, single_call=single_call)


def _floor(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def aborted(result: RequestResult) -> BadRequest:
    """The error a request that ended without an answer (aborted, or no finish at all) is on
    the APIs whose answers have no abort of their own (Messages, Responses, Ollama): 503
    unless the abort names its status."""
    reason = result.finish_reason
    message = reason.message if reason is not None else None
    status = reason.status_code if reason is not None else None
    return BadRequest(f"request aborted: {message or 'no reason given'}", status=status or 503)


def finish_reason(result: RequestResult) -> str | None:
    """OpenAI's finish_reason: "stop", "length", or vLLM's "abort"; None while running."""
    return None if result.finish_reason is None else result.finish_reason.kind
