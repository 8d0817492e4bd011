"""SamplingParams: SGLang's `sampling_params` names, defaults and allowed ranges."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import regex as pyregex  # the `regex` package: patterns that can time out

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")
GREEDY_TEMPERATURE = 1e-6
"""Temperatures below this mean greedy decoding (SGLang's threshold)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Integer parameters (counts, lengths) must fit in int64: the engine core's wire format takes
no larger ints. A seed may be any integer: only its low 64 bits are used."""

MAX_BAD_WORDS = 128
"""Most bad_words one request may give."""
MAX_STOP_REGEX = 16
"""Most stop_regex patterns one request may give."""
MAX_STOP_REGEX_CHARS = 1024
"""Longest stop_regex pattern."""
LOGIT_BIAS_MAX = 100
"""OpenAI's bound on a logit_bias value (either sign)."""
TOKEN_KEY = re.compile(r"[0-9]{1,19}")
"""A logit_bias key as JSON gives it: a token id in decimal."""

# SGLang parameters we know but do not implement yet: null (or an empty value, which is
# what the SGLang frontend sends when unset) is accepted, anything else is rejected.
UNSUPPORTED_PARAMS = ("custom_params",)


@dataclass
class SamplingParams:
    """How to sample one request's output. `from_dict` parses, `verify` validates."""

    max_new_tokens: int = 128
    """Most tokens to generate; 0 = prefill only (fills the prefix cache)."""
    min_new_tokens: int = 0
    """EOS and stop_token_ids are blocked until this many tokens were generated."""
    temperature: float = 1.0
    """Softmax temperature; below 1e-6 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens whose mass reaches top_p, (0, 1]."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 = all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, [0, 1]."""
    frequency_penalty: float = 0.0
    """Subtracted from a logit once per earlier occurrence in the output, [-2, 2]."""
    presence_penalty: float = 0.0
    """Subtracted from a logit once if the token occurs in the output, [-2, 2]."""
    repetition_penalty: float = 1.0
    """HF-style penalty on tokens in the prompt or output (>1 discourages), (0, 2]."""
    stop: str | list[str] | None = None
    """Stop string(s); the matched string is trimmed from the text unless no_stop_trim."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (in addition to EOS)."""
    stop_regex: str | list[str] | None = None
    """Regular expression(s) that end generation once the output's tail (its last
    STOP_REGEX_TAIL_TOKENS tokens) contains a match; the match stays in the text (SGLang's)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    n: int = 1
    """Number of parallel samples for the prompt."""
    sampling_seed: int | None = None
    """Seed for this request's draws; None = a random seed chosen by the engine."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the decoded text."""
    spaces_between_special_tokens: bool = True
    """Put spaces between special tokens in the decoded text."""
    no_stop_trim: bool = False
    """Keep the matched stop string at the end of the text."""
    regex: str | None = None
    """Constrain the output to match this regular expression."""
    json_schema: str | dict | None = None
    """Constrain the output to JSON valid for this schema (a JSON string or an object)."""
    ebnf: str | None = None
    """Constrain the output to this EBNF grammar (GBNF dialect, start rule `root`)."""
    structural_tag: str | dict | None = None
    """Constrain tagged spans of the output (SGLang's / xgrammar's structural tag, a JSON
    string or an object): SGLang's {"structures": [{"begin", "schema", "end"}], "triggers"}
    (text is free until a trigger, then the tag's JSON follows), or xgrammar's {"type":
    "structural_tag", "format": {...}}."""
    reasoning_end: str | None = None
    """The text that ends the output's reasoning (a reasoning parser's end marker): the
    constraint (regex, json_schema, ebnf) applies only after it; before it, output is free."""
    max_reasoning_tokens: int | None = None
    """Most reasoning tokens: reasoning that reaches it is ended by forcing `reasoning_end`
    (requires it); None: unbounded."""
    logit_bias: dict[str, float] | None = None
    """Added to the logits of the token ids it names (keys: token ids as decimal strings, as
    OpenAI and SGLang send them; values in [-100, 100]) before penalties and sampling: -100
    bans a token, 100 all but forces it."""
    stream_interval: int | None = None
    """Stream this request's tokens every this many (its first and its end at once); None:
    the engine's --stream-interval."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these token ids may be sampled (the others are masked out); None: all."""
    bad_words: list[str] | None = None
    """vLLM's: words never generated (tokenized with and without a leading space at intake,
    into bad_words_ids; each word's last token is banned where the output ends with the
    rest)."""
    bad_words_ids: list[list[int]] | None = None
    """The token sequences bad_words become (or given directly)."""
    speculative: bool = True
    """Let the engine speculate for this request when it runs with --speculative-algorithm;
    false: decode one token per step (the output is the same either way)."""

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Parses a request's `sampling_params`; None values mean default. Does not verify."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object; got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in d.items():
            if key in UNSUPPORTED_PARAMS:
                if value is not None and value != [] and value != "":
                    raise ValueError(f"sampling parameter {key!r} is not supported yet")
            elif key not in names:
                raise ValueError(f"sampling_params.{key} is not a known sampling parameter")
            elif value is not None:
                kwargs[key] = _as_float(key, value) if key in FLOAT_PARAMS else value
        return cls(**kwargs)

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature ~0, or top_k == 1 (the same thing)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def stop_strs(self) -> list[str]:
        """`stop` as a list of non-empty strings (`stop` itself is left as given)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def stop_regex_strs(self) -> list[str]:
        """`stop_regex` as a list of non-empty patterns."""
        stops = [self.stop_regex] if isinstance(self.stop_regex, str) else self.stop_regex
        return [s for s in stops or [] if s]

    @property
    def needs_matcher(self) -> bool:
        """Whether decoding is steered: a constraint, or a reasoning budget to enforce."""
        return self.grammar is not None or self.max_reasoning_tokens is not None

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The output constraint as (kind, spec): (one of GRAMMAR_KINDS, text)."""
        for kind in GRAMMAR_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value if isinstance(value, str) else json.dumps(value)
        return None

    def verify(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first invalid parameter and its allowed values."""
        _check_grammar(self)
        _check_int("max_new_tokens", self.max_new_tokens, "an integer >= 0", lambda v: v >= 0)
        _check_int("min_new_tokens", self.min_new_tokens, "an integer >= 0", lambda v: v >= 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}); "
                f"got {self.min_new_tokens}"
            )
        _check_float("temperature", self.temperature, "a number >= 0", lambda v: v >= 0)
        _check_float("top_p", self.top_p, "a number in (0, 1]", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, "-1 (all) or an integer >= 1", lambda v: v == -1 or v >= 1)
        _check_float("min_p", self.min_p, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        for name in ("frequency_penalty", "presence_penalty"):
            _check_float(name, getattr(self, name), "a number in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_float(
            "repetition_penalty",
            self.repetition_penalty,
            "a number in (0, 2]",
            lambda v: 0 < v <= 2,
        )
        _check_int("n", self.n, "an integer >= 1", lambda v: v >= 1)
        if self.stream_interval is not None:
            _check_int("stream_interval", self.stream_interval, "an integer >= 1 or null",
                       lambda v: v >= 1)  # fmt: skip
        seed = self.sampling_seed  # any integer: only its low 64 bits are used
        if seed is not None and not is_int(seed):
            raise ValueError(f"sampling_seed must be an integer or null; got {seed!r}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            _check_bool(name, getattr(self, name))
        _check_bool("no_stop_trim", self.no_stop_trim)
        _check_bool("speculative", self.speculative)
        _check_stop(self.stop)
        check_stop_regex(self.stop_regex)
        _check_token_ids(self.stop_token_ids, vocab_size)
        check_logit_bias(self.logit_bias, vocab_size)
        _check_allowed_token_ids(self.allowed_token_ids, vocab_size)
        check_bad_words(self.bad_words, self.bad_words_ids, vocab_size)
        _check_reasoning(self)

    def logit_bias_items(self) -> list[tuple[int, float]]:
        """`logit_bias` as (token id, bias) pairs (call after `verify`)."""
        return [(int(token), float(bias)) for token, bias in (self.logit_bias or {}).items()]


FLOAT_PARAMS = frozenset(f.name for f in fields(SamplingParams) if f.type == "float")
"""The parameters typed float: ints given for them are parsed as floats."""


def is_int(value: object) -> bool:
    """An int, not a bool (JSON true is not 1 here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_ids(value: object) -> bool:
    """A list of ints (not bools); empty counts (the caller says whether it may be)."""
    return isinstance(value, list) and all(is_int(t) for t in value)


def is_int64(value: object) -> bool:
    """An int (not a bool) that fits in int64."""
    return is_int(value) and INT64_MIN <= value <= INT64_MAX


def _check_int(name: str, value: object, allowed: str, ok: Callable[[int], bool]) -> None:
    if not is_int(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
    if not is_int64(value):
        raise ValueError(f"{name} must fit in a signed 64-bit integer; got {value!r}")


def _as_float(name: str, value: object) -> object:
    """An int given for a float parameter as that float (the core's wire takes no int past
    64 bits); anything else unchanged, for `verify` to judge."""
    if not is_int(value):
        return value
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number; got an integer too large") from None


def _check_float(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(_as_float(name, value)) or not ok(value):
        raise ValueError(f"{name} must be {allowed}; got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false; got {value!r}")


def _check_stop(stop: object) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings; got {stop!r}")


def check_stop_regex(value: object) -> None:
    """A pattern or a list of at most MAX_STOP_REGEX, each at most MAX_STOP_REGEX_CHARS long,
    that compile (the `regex` module's syntax, a superset of `re`'s)."""
    if value is None:
        return
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"stop_regex must be a string or a list of strings; got {value!r}"[:200])
    if len(patterns) > MAX_STOP_REGEX or any(len(p) > MAX_STOP_REGEX_CHARS for p in patterns):
        raise ValueError(
            f"stop_regex takes at most {MAX_STOP_REGEX} patterns of at most "
            f"{MAX_STOP_REGEX_CHARS} characters"
        )
    for pattern in patterns:
        try:
            pyregex.compile(pattern)
        except (pyregex.error, RecursionError, OverflowError) as exc:
            raise ValueError(f"stop_regex {pattern[:80]!r} does not compile: {exc}") from None


def _check_token_ids(ids: object, vocab_size: int | None, name: str = "stop_token_ids") -> None:
    """A list of token ids in the vocabulary (stop_token_ids, allowed_token_ids, a bad word)."""
    if ids is None:
        return
    allowed = "a list of token ids" + ("" if vocab_size is None else f" in [0, {vocab_size})")
    in_range = (lambda v: 0 <= v) if vocab_size is None else (lambda v: 0 <= v < vocab_size)
    if not isinstance(ids, (list, tuple, set)) or not all(is_int(v) and in_range(v) for v in ids):
        raise ValueError(f"{name} must be {allowed}; got {ids!r}"[:240])


def check_logit_bias(bias: object, vocab_size: int | None) -> None:
    """A map of token ids (decimal strings or ints) in the vocabulary to numbers in
    [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias; got {bias!r}"[:200])
    top = "" if vocab_size is None else f" in [0, {vocab_size})"
    for token, value in bias.items():
        as_int = int(token) if isinstance(token, str) and TOKEN_KEY.fullmatch(token) else token
        if not is_int64(as_int) or as_int < 0 or (vocab_size is not None and as_int >= vocab_size):
            raise ValueError(f"logit_bias keys must be token ids{top}; got {token!r}"[:200])
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:
            message = f"logit_bias values must be numbers in [-100, 100]; got {token!r}: {value!r}"
            raise ValueError(message[:200])


def _check_allowed_token_ids(ids: object, vocab_size: int | None) -> None:
    if ids is None:
        return
    _check_token_ids(ids, vocab_size, "allowed_token_ids")
    if not ids:
        raise ValueError("allowed_token_ids must name at least one token id (null: all)")


def check_bad_words(words: object, ids: object, vocab_size: int | None) -> None:
    """bad_words: at most MAX_BAD_WORDS non-blank strings; bad_words_ids: token id lists of
    1 to 64 ids in the vocabulary, at most twice as many."""
    if words is not None:
        ok = isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)
        if not ok or len(words) > MAX_BAD_WORDS or any(len(w) > 256 for w in words):
            message = f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings"
            raise ValueError(f"{message} of at most 256 characters; got {words!r}"[:240])
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > 2 * MAX_BAD_WORDS:
            raise ValueError(f"bad_words_ids must be a list of token id lists; got {ids!r}"[:240])
        for word in ids:
            _check_token_ids(word, vocab_size, "bad_words_ids")
            if not word or len(word) > 64:
                raise ValueError("bad_words_ids: each word must be 1 to 64 token ids")


def _check_reasoning(params: SamplingParams) -> None:
    end, budget = params.reasoning_end, params.max_reasoning_tokens
    if end is not None and (not isinstance(end, str) or not end):
        raise ValueError(f"reasoning_end must be a non-empty string or null; got {end!r}")
    if budget is not None:
        _check_int("max_reasoning_tokens", budget, "an integer >= 0", lambda v: v >= 0)
        if end is None:
            raise ValueError("max_reasoning_tokens requires reasoning_end")


def _check_grammar(params: SamplingParams) -> None:
    given = [kind for kind in GRAMMAR_KINDS if getattr(params, kind) is not None]
    if len(given) > 1:
        raise ValueError(f"{given[1]}: give at most one of {', '.join(GRAMMAR_KINDS)}; got {given}")
    for kind in ("regex", "ebnf"):
        value = getattr(params, kind)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{kind} must be a non-empty string; got {value!r}")
    for kind in ("json_schema", "structural_tag"):
        value = getattr(params, kind)
        if value is not None and not isinstance(value, (str, dict)):
            raise ValueError(f"{kind} must be a JSON string or an object; got {value!r}"[:200])
