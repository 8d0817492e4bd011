"""Scoring (SGLang's `/v1/score` and `Engine.score`): how likely each of a few label tokens is
to come next after a query joined with each of several items, in one call.

Each item is one request: the query and the item joined (`query + item`, or `item + query`
with `item_first`; strings joined before tokenizing, token ids as lists), one greedy token
whose distribution is read at the last prompt position through `token_ids_logprob` (the
prefill computes it; no decode step runs). The items share the query's pages: the radix tree
(and the in-batch dedupe of admission) computes a shared query once. Each item's scores are in
the order of `label_token_ids`: the labels' probabilities under the whole vocabulary, or with
`apply_softmax` their softmax among themselves (they sum to 1), as SGLang's.

A sequence classifier (`--is-embedding` with a `*ForSequenceClassification` checkpoint, e.g.
a cross-encoder reranker) scores with its own head instead: each item's raw outputs, their
softmax with `apply_softmax`; it takes no `label_token_ids`.
"""

from __future__ import annotations

import math
from typing import Any

from radixserve.client.embedding import embed_args, embedding_vector
from radixserve.client.request_builder import GenerateArgs
from radixserve.client.result import RequestResult
from radixserve.sampling.params import is_token_ids

MAX_ITEMS = 2048
"""Most items one call may score (as many inputs as one embeddings call)."""
SCORE_NAMES = {"text": "items", "input_ids": "items", "token_ids_logprob": "label_token_ids",
               "prompt": "items", "n": "items"}  # fmt: skip
"""Request validation messages' field names as scoring calls them (a prompt is query + item)."""
NEXT_TOKEN = {"max_new_tokens": 1, "temperature": 0.0}
"""One token: its logprobs are the prompt's next-token distribution, read at prefill."""


SCORING_NEEDS = (
    "Scoring needs a generating model (label token probabilities) or a sequence classifier "
    "(its head's outputs); this is an embedding model: embed instead (/v1/embeddings, "
    "Engine.encode)"
)


def scores_with_head(is_embedding: bool, num_labels: int | None) -> bool:
    """Whether scoring reads a classifier's head (True) or label tokens' logprobs (False);
    an embedding model has neither (ValueError)."""
    if is_embedding and num_labels is None:
        raise ValueError(SCORING_NEEDS)
    return num_labels is not None


def score_args(
    query: Any,
    items: Any,
    label_token_ids: Any,
    item_first: Any = False,
    classifier: bool = False,
    **fields: Any,
) -> GenerateArgs:
    """The requests of one scoring call (one per item); `classifier`: the model is a sequence
    classifier. `fields` are further GenerateArgs fields (cache_salt, lora_path, priority).
    ValueError names the parameter at fault."""
    if not isinstance(item_first, bool):
        raise ValueError(f"item_first must be a boolean; got {item_first!r}"[:200])
    kind, prompts = _prompts(query, items, item_first)
    if classifier:
        if label_token_ids is not None:
            raise ValueError(
                "label_token_ids: the model is a sequence classifier and scores its own labels; "
                "leave it out"
            )
        return embed_args(**{kind: prompts}, **fields)
    labels = check_label_token_ids(label_token_ids)
    return GenerateArgs(
        **{kind: prompts},
        sampling_params=dict(NEXT_TOKEN),
        return_logprob=True,
        token_ids_logprob=labels,
        **fields,
    )


def check_label_token_ids(value: Any) -> list[int]:
    """A non-empty list of token ids (their range is the request builder's check)."""
    if not value or not is_token_ids(value):
        raise ValueError(
            f"label_token_ids must be a non-empty list of token ids; got {value!r}"[:200]
        )
    return value


def item_scores(
    result: RequestResult, apply_softmax: bool, classifier: bool = False
) -> list[float]:
    """One item's scores from its finished request: the label tokens' probabilities (or
    their softmax among themselves), or a classifier's outputs (or their softmax)."""
    if classifier:
        values = [float(v) for v in embedding_vector(result, normalize=False)]
        return softmax(values) if apply_softmax else values
    if not result.output_token_ids_logprobs:
        raise RuntimeError(f"request {result.spec.rid} ended without its label logprobs")
    logprobs = [entry[0] for entry in result.output_token_ids_logprobs[0]]
    return softmax(logprobs) if apply_softmax else [math.exp(v) for v in logprobs]


def _prompts(query: Any, items: Any, item_first: bool) -> tuple[str, list]:
    """("text", the joined strings) or ("input_ids", the joined lists)."""
    items = [items] if isinstance(items, str) else items
    if not isinstance(items, list) or not items:
        raise ValueError("items must be a string, a non-empty list of strings or of token-id lists")
    if len(items) > MAX_ITEMS:
        raise ValueError(f"items has {len(items)} entries; at most {MAX_ITEMS}")
    if isinstance(query, str) and all(isinstance(item, str) for item in items):
        return "text", [item + query if item_first else query + item for item in items]
    if is_token_ids(query) and all(is_token_ids(item) for item in items):
        return "input_ids", [item + query if item_first else query + item for item in items]
    raise ValueError(
        "query and items must both be text (a string; a string or list of strings) or both "
        "token ids (a list of ids; a list of id lists)"
    )


def softmax(values: list[float]) -> list[float]:
    """The softmax of a few scores (label logprobs, a classifier's outputs)."""
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def sigmoid(x: float) -> float:
    """The logistic function, without overflow for large |x| (a one-output head's activation)."""
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
