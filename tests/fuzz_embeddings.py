"""Fuzz bodies and answer checks for an --is-embedding server's routes (test_embeddings.py):
/encode and /v1/embeddings (OpenAI's error shape, `param` naming a field of the body) and
/api/embed, /api/embeddings (Ollama's, the message starting with one). Every answer is a 200
holding one embedding per input, or such a 4xx; never a 5xx or a hang."""

from __future__ import annotations

import json
from typing import Any

from fuzz_agent_apis import starts_with_a_field
from fuzz_common import fuzzed, odd, openai_error_problems, top_fields
from hypothesis import strategies as st

IDS = st.lists(st.integers(200, 4000), min_size=1, max_size=12)
TEXT = st.text(max_size=40)
OPENAI_BODY = st.fixed_dictionaries(
    {"input": TEXT | st.lists(TEXT, min_size=1, max_size=3) | IDS | st.lists(IDS, max_size=3)},
    optional={
        "model": st.just("emb"),
        "encoding_format": st.sampled_from(["float", "base64"]),
        "dimensions": st.integers(1, 64),
        "normalize": st.booleans(),
        "add_special_tokens": st.booleans(),
        "truncate_prompt_tokens": st.sampled_from([-1, 4]),
        "cache_salt": st.sampled_from(["t1", "t2"]),
        "request_id": st.just("rq"),
        "user": st.just("u"),
    },
)
OPENAI_ODD = {
    "input": odd("", [], [[]], [-1], [[1], "a"], [10**9], ["a"] * 2100),
    "model": odd("other", 5),
    "encoding_format": odd("int8", 1),
    "dimensions": odd(0, 65, 1.5, True),
    "normalize": odd("yes"),
    "add_special_tokens": odd(1),
    "truncate_prompt_tokens": odd(0, -2, 2**70),
    "cache_salt": odd(5),
    "request_id": odd("", 3),
    "priority": odd(1, "high"),
}
ENCODE_BODY = st.fixed_dictionaries(
    {},
    optional={
        "text": TEXT | st.lists(TEXT, min_size=1, max_size=3),
        "input_ids": IDS | st.lists(IDS, min_size=1, max_size=3),
        "rid": st.just("r"),
        "cache_salt": st.just("t1"),
    },  # fmt: skip
)
ENCODE_ODD = {"text": odd(5, [], [1]), "input_ids": odd([], [-1], "x"), "rid": odd("", 5),
              "sampling_params": odd({}), "lora_path": odd("nope")}  # fmt: skip
OLLAMA_BODY = st.fixed_dictionaries(
    {"model": st.sampled_from(["emb", "emb:latest"]), "input": TEXT | st.lists(TEXT, max_size=3)},
    optional={
        "truncate": st.booleans(),
        "dimensions": st.integers(1, 64),
        "options": st.just({"num_ctx": 2048}),
        "keep_alive": st.just("5m"),
    },  # fmt: skip
)
OLLAMA_ODD = {"model": odd("", "other", 3), "input": odd(3, [3], None), "truncate": odd("no"),
              "dimensions": odd(0, 99), "options": odd([1], "x")}  # fmt: skip
LEGACY_BODY = st.fixed_dictionaries({"model": st.just("emb"), "prompt": TEXT})
LEGACY_ODD = {"model": odd("other"), "prompt": odd(3, ["a"]), "options": odd(1)}

RERANK_ODD = {"query": odd("", 5, ["a"]), "documents": odd([], [""], "a", [1], ["a"] * 2100),
              "top_n": odd(-1, 1.5, "2"), "model": odd("other"), "return_documents": odd("no"),
              "truncate_prompt_tokens": odd(0, "x"), "instruct": odd("", 3)}  # fmt: skip


def rerank_cases(model: str):
    """(path, body) of SGLang's /v1/rerank and vLLM's /rerank for a server serving `model`."""
    body = st.fixed_dictionaries(
        {"query": TEXT, "documents": st.lists(TEXT, min_size=1, max_size=4)},
        optional={"top_n": st.integers(0, 5), "model": st.just(model),
                  "return_documents": st.booleans(), "cache_salt": st.just("t1"),
                  "truncate_prompt_tokens": st.sampled_from([-1, 4])},
    )  # fmt: skip
    return st.tuples(st.sampled_from(["/v1/rerank", "/rerank"]), fuzzed(body, RERANK_ODD))


EMBEDDING_CASES = st.one_of(
    rerank_cases("emb"),
    st.tuples(st.just("/v1/embeddings"), fuzzed(OPENAI_BODY, OPENAI_ODD)),
    st.tuples(st.just("/encode"), fuzzed(ENCODE_BODY, ENCODE_ODD)),
    st.tuples(st.just("/api/embed"), fuzzed(OLLAMA_BODY, OLLAMA_ODD)),
    st.tuples(st.just("/api/embeddings"), fuzzed(LEGACY_BODY, LEGACY_ODD)),
)
DERIVED = {"body", "model", "input", "prompt", "text", "query", "documents"}
"""Names a 4xx may give besides the body's own fields: the body, required fields missing,
the prompt as the core calls it."""


def embedding_problems(path: str):
    """The answer check of `path`: (body, status, text) -> what is wrong with it."""

    def problems(body: Any, status: int, text: str) -> list[str]:
        if status >= 500:
            return [f"{status}: {text[:300]}"]
        fields = top_fields(body) | DERIVED
        if status >= 400 and path.startswith("/api/"):
            message = json.loads(text).get("error")
            ok = isinstance(message, str) and starts_with_a_field(message, fields)
            return [] if ok else [f"{status} names no field first: {text[:300]}"]
        if status >= 400:
            return openai_error_problems(fields, status, text)
        answer = json.loads(text)
        if path.endswith("rerank"):
            return _ranking_problems(body, answer)
        vectors = {
            "/v1/embeddings": lambda: [d["embedding"] for d in answer["data"]],
            "/encode": lambda: [a["embedding"] for a in answer] if isinstance(answer, list)
            else [answer["embedding"]],
            "/api/embed": lambda: answer["embeddings"],
            "/api/embeddings": lambda: [answer["embedding"]],
        }[path]()  # fmt: skip
        return [] if all(v is not None for v in vectors) else [f"no embedding: {text[:300]}"]

    return problems


def _ranking_problems(body: dict, answer) -> list[str]:
    """A 200 ranks at most top_n of the documents, each once, most relevant first."""
    items = answer if isinstance(answer, list) else answer["results"]
    scores = [i["score"] if "score" in i else i["relevance_score"] for i in items]
    indices = [i["index"] for i in items]
    limit = body.get("top_n") or len(body["documents"])
    ok = len(items) == min(limit, len(body["documents"])) and len(set(indices)) == len(indices)
    return [] if ok and scores == sorted(scores, reverse=True) else [f"bad ranking: {answer}"[:300]]
