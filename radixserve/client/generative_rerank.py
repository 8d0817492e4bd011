"""A generating model as a reranker (Qwen3-Reranker's recipe, which SGLang's `instruct` field
serves): each (query, document) pair becomes a chat whose system turn asks for a "yes" or a
"no", rendered by the model's own chat template (thinking off), and the relevance is
P(yes) / (P(yes) + P(no)) at the reply's first token, read at prefill as scoring reads its
labels (client/scoring.py). The system turn, the instruction and the query come first, so a
call's prompts share them in the radix tree.

Qwen3-Reranker checkpoints are trained on exactly this prompt; any other chat model answers it
zero-shot.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from radixserve.client.request_builder import GenerateArgs
from radixserve.client.result import RequestResult
from radixserve.client.scoring import NEXT_TOKEN

JUDGE_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
"""Qwen3-Reranker's default task, used when a request gives no `instruct`."""
MAX_INSTRUCT_CHARS = 4096


def judge_messages(instruct: str, query: str, document: str) -> list[dict[str, str]]:
    user = f"<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {document}"
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def check_instruct(value: Any) -> str:
    """SGLang's `instruct`: the task the documents are judged for (DEFAULT_INSTRUCT if None)."""
    if value is None:
        return DEFAULT_INSTRUCT
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_INSTRUCT_CHARS:
        raise ValueError(f"instruct must be a non-empty string of at most {MAX_INSTRUCT_CHARS} "
                         f"characters; got {value!r}"[:200])  # fmt: skip
    return value


def yes_no_ids(tokenizer) -> list[int]:
    """The vocabulary's "no" and "yes" tokens, in that order."""
    ids = [tokenizer.convert_tokens_to_ids(word) for word in ("no", "yes")]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError("Reranking with a generating model needs 'yes' and 'no' tokens")
    return ids


def judge_args(
    tokenizer, instruct: str, pairs: list[tuple[str, str]], **fields: Any
) -> GenerateArgs:
    """One next-token request per (query, document) pair, whose logprobs of "no" and "yes"
    give its relevance. ValueError: no chat template."""
    if tokenizer.chat_template is None:
        raise ValueError("Reranking with a generating model needs its chat template; it has none")
    prompts = [_judged_prompt(tokenizer, judge_messages(instruct, q, d)) for q, d in pairs]
    return GenerateArgs(input_ids=prompts, sampling_params=dict(NEXT_TOKEN), return_logprob=True,
                        token_ids_logprob=yes_no_ids(tokenizer), **fields)  # fmt: skip


def _judged_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The judged chat's tokens; a template that refuses a system turn (Gemma's, Mistral's)
    gets its text at the head of the user turn. ValueError: the template refuses both."""
    kwargs = {"tokenize": False, "add_generation_prompt": True, "enable_thinking": False}
    try:
        text = tokenizer.apply_chat_template(messages, **kwargs)
    except TemplateError:
        system, user = messages
        merged = [{"role": "user", "content": system["content"] + "\n\n" + user["content"]}]
        try:
            text = tokenizer.apply_chat_template(merged, **kwargs)
        except TemplateError as exc:
            raise ValueError(f"documents could not be judged by the chat template: {exc}") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def judged_logit(result: RequestResult) -> float:
    """log P(yes) - log P(no) at the request's first token: the sigmoid of it is
    P(yes) / (P(yes) + P(no)), the relevance."""
    if not result.output_token_ids_logprobs:
        raise RuntimeError(f"request {result.spec.rid} ended without its yes / no logprobs")
    no, yes = (entry[0] for entry in result.output_token_ids_logprobs[0])
    return yes - no
