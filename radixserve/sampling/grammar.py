"""Constrained decoding through xgrammar: regex, JSON schema, EBNF and structural tags.

JSON is generated compact (no free whitespace between tokens), so a small model cannot
wander off into endless indentation; the JSON is the same value either way.

`check_grammar` parses a constraint without a tokenizer (cheap; used to reject bad input
before a request is queued). `GrammarBackend` compiles constraints against the model's
vocabulary on a worker thread, caches compiled grammars (an LRU of `max_entries`, failures
included: a constraint comes from the client, so the cache must not grow with them), and
masks a batch's logits.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.sampling.params import SamplingParams
from radixserve.sampling.reasoning_grammar import ReasoningMatcher

# xgrammar (0.2.9) writes the characters of a length-bounded JSON string (maxLength,
# minLength) as the first class, which lets raw control characters in; JSON forbids them
# unescaped, and its unbounded strings already use the second.
LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def _xgr():
    import xgrammar

    return xgrammar


def check_grammar(kind: str, spec: str) -> None:
    """Raises ValueError naming `kind` when the constraint does not parse."""
    xgr = _xgr()
    build = {
        "regex": xgr.Grammar.from_regex,
        "json_schema": xgr.Grammar.from_json_schema,
        "ebnf": xgr.Grammar.from_ebnf,
        "structural_tag": structural_tag_grammar,
    }[kind]
    try:
        build(spec)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError/InvalidJSONError
        raise ValueError(f"{kind} is invalid: {exc}") from exc


def json_schema_ebnf(spec: str) -> str:
    """The schema's grammar as xgrammar's EBNF: compact JSON (no free whitespace), no raw
    control characters inside strings."""
    grammar = _xgr().Grammar.from_json_schema(spec, any_whitespace=False)
    return str(grammar).replace(LOOSE_STRING_CHAR, STRICT_STRING_CHAR)


STRUCTURAL = "structural_tag"


def structural_tag_grammar(spec: str):
    """The grammar of a structural tag: SGLang's form ({"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}, as its OpenAI `response_format` takes it) is written as
    xgrammar's triggered tags; xgrammar's own form ({"type": "structural_tag", "format"})
    is taken as it is. The tags' JSON is compact, as `json_schema`'s is."""
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        tag = _triggered_tags(tag)
    return _xgr().Grammar.from_structural_tag(json.dumps(_compact_json(tag)))


def _compact_json(node: Any) -> Any:
    """`node` with each {"type": "json_schema", "json_schema": S} content written as the
    grammar of `json_schema_ebnf` (xgrammar's own lets any whitespace in)."""
    if isinstance(node, list):
        return [_compact_json(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and set(node) == {"type", "json_schema"}:
        schema = node["json_schema"]
        schema = schema if isinstance(schema, str) else json.dumps(schema)
        return {"type": "grammar", "grammar": json_schema_ebnf(schema)}
    return {key: _compact_json(value) for key, value in node.items()}


def _triggered_tags(tag: dict[str, Any]) -> dict[str, Any]:
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if set(tag) - {"type", "structures", "triggers"} or tag.get("type") not in (None, STRUCTURAL):
        raise ValueError(f'takes "type": "{STRUCTURAL}", "structures" and "triggers" only')
    if not isinstance(structures, list) or not all(_is_structure(s) for s in structures):
        raise ValueError(
            'structures must be a list of {"begin": str, "schema": object, "end": str}'
        )
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) for t in triggers)
    ):
        raise ValueError("triggers must be a non-empty list of strings")
    tags = [
        {
            "type": "tag",
            "begin": s["begin"],
            "content": {"type": "json_schema", "json_schema": s.get("schema") or {}},
            "end": s["end"],
        }
        for s in structures
    ]
    return {
        "type": STRUCTURAL,
        "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags},
    }


def _is_structure(value: Any) -> bool:
    if not isinstance(value, dict) or set(value) - {"begin", "schema", "end"}:
        return False
    schema = value.get("schema")
    begin, end = value.get("begin"), value.get("end")
    return (
        isinstance(begin, str) and isinstance(end, str) and isinstance(schema, (dict, type(None)))
    )


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    cache_evictions: int = 0
    cache_entries: int = 0  # constraints cached now: at most max_entries


class GrammarBackend:
    """Compiles constraints once per (kind, spec) while cached and hands out per-request
    matchers."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        max_entries: int = 64,
    ):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1; got {max_entries}")
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.max_entries = max_entries
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.stats = GrammarStats()

    def compile_async(self, kind: str, spec: str) -> Future:
        """A future of the compiled grammar (or of its ValueError); the same constraint
        compiles once while it stays among the `max_entries` most recently used. An entry
        dropped while compiling still completes for the requests holding its future."""
        key = (kind, spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return future
            self.stats.compiles += 1
            future = self._executor.submit(self._compile, kind, spec)
            self._cache[key] = future
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
                self.stats.cache_evictions += 1
            self.stats.cache_entries = len(self._cache)
            return future

    def __len__(self) -> int:
        """Constraints cached (compiled, compiling or failed)."""
        return len(self._cache)

    def _compile(self, kind: str, spec: str):
        compile_fn = {
            "regex": self._compiler.compile_regex,
            "json_schema": lambda schema: self._compiler.compile_grammar(json_schema_ebnf(schema)),
            "ebnf": self._compiler.compile_grammar,
            "structural_tag": lambda tag: self._compiler.compile_grammar(
                structural_tag_grammar(tag)
            ),
        }[kind]
        try:
            return compile_fn(spec)
        except Exception as exc:
            raise ValueError(f"{kind} is invalid: {exc}") from exc

    def matcher(self, compiled, params: SamplingParams | None = None) -> Any:
        """A request's matcher of `compiled` (None: no constraint); with `params.reasoning_end`
        it applies after the reasoning (sampling/reasoning_grammar.py)."""
        inner = None if compiled is None else _xgr().GrammarMatcher(compiled)
        if params is None or params.reasoning_end is None:
            return inner
        end, budget = params.reasoning_end, params.max_reasoning_tokens
        return ReasoningMatcher(inner, self.tokenizer, end, budget)

    def mask_draft_rows(self, logits: torch.Tensor, matcher: Any, draft: list[int]) -> None:
        """Masks, in place, speculative decoding's verify rows of one request: row j with
        the matcher advanced over draft[:j] (a valid prefix, see `valid_draft`); the matcher
        ends where it started.

        logits: [len(draft) + 1, vocab_size] fp32
        """
        xgr = _xgr()
        bitmask = xgr.allocate_token_bitmask(len(draft) + 1, self.vocab_size)
        for j, token in enumerate([*draft, None]):
            matcher.fill_next_token_bitmask(bitmask, j)
            if token is not None and not matcher.accept_token(token):
                raise ValueError(f"draft token {token} violates the grammar")
        if draft:
            matcher.rollback(len(draft))
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))

    @staticmethod
    def valid_draft(matcher: Any, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` the grammar allows without ending (the token that
        ends it is the target's to choose); the matcher ends where it started."""
        num = 0
        for token in draft:
            if not matcher.accept_token(token):
                break
            num += 1
            if matcher.is_terminated():
                num -= 1
                matcher.rollback(1)
                break
        if num:
            matcher.rollback(num)
        return draft[:num]

    def mask_logits(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """Sets to -inf, in place, every token a row's matcher forbids (None: unconstrained).

        logits: [num_rows, vocab_size] fp32
        """
        xgr = _xgr()
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
