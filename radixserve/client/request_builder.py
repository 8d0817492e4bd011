"""The one request type and its validation: every API maps its input to `GenerateArgs`, and
`RequestBuilder.build` turns that into validated RequestSpecs (one per output: n per prompt),
each with a fresh unique request_id.

    /generate body           server/app.py           parse_generate  -+
    OpenAI chat/completions  server/openai_api.py    build_specs      |
    /cache/pin body          server/cache_api.py     pin_prefix       +-> GenerateArgs
    Engine.generate kwargs   client/engine.py        _generate_args   |     -> RequestBuilder.build
    frontend gen/run         frontend_lang: GenParams -> /generate  -+       -> [RequestSpec]

So every API rejects the same bad input with the same ValueError naming the offending field.
"""

from __future__ import annotations

import math
import random
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from radixserve.cache.retention import check_pin_name, session_pin_key
from radixserve.client.bootstrap_fields import BOOTSTRAP_FIELDS, bootstraps
from radixserve.engine.protocol import PinRequest, RequestSpec
from radixserve.engine.request import LORA_NAMESPACE_SEP, MAX_LOGPROBS, LogprobRequest
from radixserve.sampling.grammar import check_grammar
from radixserve.sampling.params import (
    INT64_MAX,
    SamplingParams,
    check_bad_words,
    is_int,
    is_int64,
)

REQUEST_OPTIONS = (
    "priority", "session_id", "retention", "extra_key", "truncate_prompt_tokens",
    *BOOTSTRAP_FIELDS,
)  # fmt: skip
"""Per-request options beside the prompt, sampling and logprobs, under the same names in every
API that exposes them: /generate and OpenAI bodies, Engine.generate, the frontend's gen."""
GENERATION_REFUSED = ("The model serves embeddings (--is-embedding) and does not generate: use "
                      "/encode, /v1/embeddings, /api/embed or Engine.encode")  # fmt: skip
EMBEDDINGS_NEED_THE_FLAG = (
    "The model generates: embeddings need a server started with --is-embedding"
)
MAX_TOKEN_IDS_LOGPROB = 128
"""Most token ids one request's token_ids_logprob may name (each position reports them all)."""
SEED_MASK = (1 << 64) - 1
"""The sampler hashes a seed's low 64 bits, so any int seed is kept as just those: the same
draws, and a value the engine core message (msgpack, 64 bits) can carry."""


@dataclass
class GenerateArgs:
    """SGLang's generate arguments: the one request type. A new request option is a field
    here, its check in RequestBuilder, and the API mappings that expose it (/generate takes
    every field; OpenAI bodies REQUEST_OPTIONS; Engine.generate and gen the ones they name)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None  # one list, or one per prompt
    rid: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    extra_key: str | list[str] | None = None  # SGLang's: names the cache namespace after the salt
    priority: int | None = None  # higher first; needs --enable-priority-scheduling
    session_id: str | None = None  # an agent session: its next request ends its retention
    retention: dict | None = None  # {"ttl_s": s}: keep prompt + output pinned (needs session_id)
    bootstrap_host: str | list[str] | None = None  # disaggregation: the prefill worker's host
    bootstrap_port: int | list[int] | None = None  # ... its bootstrap port
    bootstrap_room: int | list[int] | None = None  # ... the room pairing prefill and decode
    lora_path: str | list[str] | None = None  # the LoRA adapter's name (--lora-paths); None: base
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each prompt's last k tokens (-1: ctx)

    @classmethod
    def from_fields(cls, values: Mapping[str, Any], **overrides: Any) -> GenerateArgs:
        """The args from those keys of `values` that are fields (the rest are the caller's:
        stream, return_text_in_logprobs, ...), then `overrides`."""
        given = {name: values[name] for name in GENERATE_ARG_NAMES if name in values}
        return cls(**(given | overrides))


GENERATE_ARG_NAMES = frozenset(f.name for f in fields(GenerateArgs))


class RequestBuilder:
    """`max_outputs`: most requests one call may make (prompts x n); the server's running +
    queued limit, since a call with more could never be admitted. `enable_priority`: the
    engine's --enable-priority-scheduling (without it a non-zero priority is refused).
    `disaggregation_mode`: prefill | decode | None (bootstrap fields are refused).
    `is_embedding`: the model serves embeddings (--is-embedding), never generation."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        context_length: int,
        capacity_tokens: int,
        max_outputs: int | None = None,
        enable_priority: bool = False,
        disaggregation_mode: str | None = None,
        lora_adapters: Mapping[str, int] | None = None,
        is_embedding: bool = False,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.capacity_tokens = capacity_tokens
        self.max_outputs = max_outputs
        self.enable_priority = enable_priority
        self.disaggregation_mode = disaggregation_mode
        self.is_embedding = is_embedding
        # LoRA adapter name -> load id, of those the engine serves (--lora-paths, and
        # /load_lora_adapter: whoever loads or unloads one updates this map)
        self.lora_adapters: dict[str, int] = dict(lora_adapters or {})
        self._rng = random.Random()

    def build(self, args: GenerateArgs, embed: bool = False) -> tuple[list[RequestSpec], bool]:
        """Validated requests (n per prompt) and whether the input was a batch; `embed`:
        embedding requests (client/embedding.py), only with --is-embedding, as generation
        only without it."""
        if embed != self.is_embedding:
            raise ValueError(GENERATION_REFUSED if self.is_embedding else EMBEDDINGS_NEED_THE_FLAG)
        token_lists, batched = self._token_lists(args.text, args.input_ids)
        token_lists = self._truncated(token_lists, args.truncate_prompt_tokens)
        count = len(token_lists)
        params_list = _per_prompt(args.sampling_params, count, "sampling_params")
        rids = _per_prompt(args.rid, count, "rid")
        salts = _per_prompt(args.cache_salt, count, "cache_salt")
        extra_keys = _per_prompt(args.extra_key, count, "extra_key")
        logprob = _logprob_request(args.return_logprob, args.logprob_start_len,
                                   args.top_logprobs_num)  # fmt: skip
        picks = self._token_ids_logprob(args.token_ids_logprob, count)
        parsed = [self.sampling_params(p) for p in params_list]
        self._check_num_outputs(sum(params.n for params in parsed))
        fields = {name: getattr(args, name) for name in BOOTSTRAP_FIELDS}
        boots = bootstraps(fields, count, self.disaggregation_mode, _per_prompt)
        loras = [self.check_lora(name) for name in _per_prompt(args.lora_path, count, "lora_path")]
        specs = []
        prompts = zip(token_lists, parsed, rids, salts, extra_keys, boots, loras, picks)
        for ids, params, rid, salt, extra_key, boot, lora, picked in prompts:
            self.check_length(ids, params)
            salt = salted_namespace(salt, extra_key)
            wants = logprob if logprob is None else replace(logprob, token_ids=picked)
            if boot is not None and params.n != 1:
                raise ValueError("bootstrap_room pairs one prefill with one decode: n must be 1")
            self.check_salt(salt)
            lora_id = None if lora is None else self.lora_adapters[lora]
            outputs = [self.new_spec(ids, params, rid, salt, wants, i) for i in range(params.n)]
            specs += [replace(spec, bootstrap=boot, lora_id=lora_id) for spec in outputs]
        specs = [replace(spec, embed=True) for spec in specs] if embed else specs
        return self.with_retention(specs, args), batched

    def _truncated(self, token_lists: list[list[int]], keep: Any) -> list[list[int]]:
        """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: the context
        length's worth)."""
        if keep is None:
            return token_lists
        if not is_int(keep) or not (keep == -1 or 1 <= keep <= INT64_MAX):
            raise ValueError(f"truncate_prompt_tokens must be -1 or an int >= 1; got {keep!r}")
        keep = self.context_length if keep == -1 else keep
        return [ids[-keep:] for ids in token_lists]

    def _token_ids_logprob(self, value: Any, count: int) -> list[tuple[int, ...]]:
        """SGLang's token_ids_logprob per prompt: one list of ids for every prompt, or a list
        of such lists, one per prompt; ids in the vocabulary, at most MAX_TOKEN_IDS_LOGPROB."""
        if value is None:
            return [()] * count
        nested = isinstance(value, list) and bool(value) and isinstance(value[0], list)
        lists = _per_prompt(value, count, "token_ids_logprob") if nested else [value] * count
        for ids in lists:
            ok = isinstance(ids, list) and len(ids) <= MAX_TOKEN_IDS_LOGPROB
            if not ok or not all(is_int(t) and 0 <= t < self.vocab_size for t in ids):
                message = (
                    f"token_ids_logprob must be a list of at most {MAX_TOKEN_IDS_LOGPROB} token "
                    f"ids in [0, {self.vocab_size}), or one such list per prompt; got {value!r}"
                )
                raise ValueError(message[:240])
        return [tuple(ids) for ids in lists]

    def check_lora(self, name: Any) -> str | None:
        """The adapter `lora_path` names (None: the base model), refused unless served."""
        if name is None:
            return None
        if not isinstance(name, str) or name not in self.lora_adapters:
            served = ", ".join(sorted(self.lora_adapters)) or "none (start with --lora-paths)"
            raise ValueError(f"lora_path {name!r} is not a loaded LoRA adapter; served: {served}")
        return name

    def check_salt(self, salt: str | None) -> None:
        """With LoRA on, a salt may not hold NUL: the core joins it with the adapter's load id
        by NUL into the cache namespace (engine/request.py `cache_namespace`)."""
        if self.lora_adapters and salt is not None and LORA_NAMESPACE_SEP in salt:
            raise ValueError("cache_salt must not contain NUL characters")

    def with_retention(self, specs: list[RequestSpec], args: GenerateArgs) -> list[RequestSpec]:
        """`specs` with the call's priority, session and retention, checked."""
        priority = _priority(args.priority, self.enable_priority)
        session_id = args.session_id
        if session_id is not None:
            check_pin_name(session_id, "session_id")
        pin = None
        if args.retention is not None:
            if session_id is None:
                raise ValueError("retention needs a session_id: the pin is the session's")
            if len(specs) != 1:
                raise ValueError(
                    f"retention needs one output (one prompt, n = 1); got {len(specs)}"
                )
            pin = PinRequest(session_pin_key(session_id), _retention_ttl(args.retention))
        fields = dict(priority=priority, session_id=session_id, pin=pin)
        return [replace(spec, **fields) for spec in specs]

    def _check_num_outputs(self, num: int) -> None:
        if self.max_outputs is not None and num > self.max_outputs:
            raise ValueError(
                f"n: the request asks for {num} outputs (prompts x n); this server runs and "
                f"queues at most {self.max_outputs} at once"
            )

    def sampling_params(self, params: dict | None) -> SamplingParams:
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"sampling_params must be an object; got {type(params).__name__}")
        parsed = SamplingParams.from_dict(params)
        parsed.verify(self.vocab_size)
        if parsed.sampling_seed is not None:
            parsed.sampling_seed &= SEED_MASK
        if parsed.grammar is not None:
            kind, text = parsed.grammar
            check_grammar(kind, text)
            setattr(parsed, kind, text)  # an object as text: the wire takes no int past int64
        if parsed.bad_words:
            words = self.bad_word_ids(parsed.bad_words)
            parsed.bad_words_ids = (parsed.bad_words_ids or []) + words
            check_bad_words(None, parsed.bad_words_ids, self.vocab_size)
        if parsed.allowed_token_ids is not None:  # the wire's form: a list
            parsed.allowed_token_ids = list(parsed.allowed_token_ids)
        if parsed.logit_bias is not None:  # the wire's form: decimal keys, float values
            parsed.logit_bias = {str(token): bias for token, bias in parsed.logit_bias_items()}
        return parsed

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each alone and after a space (as it follows
        another word), both variants kept when they differ."""
        found: list[list[int]] = []
        for word in words:
            for prefix in ("", " "):
                ids = list(self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if ids and ids not in found:
                    found.append(ids)
        return found

    def _token_lists(self, text, input_ids) -> tuple[list[list[int]], bool]:
        if (text is None) == (input_ids is None):
            raise ValueError("text or input_ids: give exactly one (the prompt)")
        if text is not None:
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("text must be a string or a non-empty list of strings")
            return [self.tokenizer.encode(t) for t in texts], batched
        batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        lists = input_ids if batched else [input_ids]
        for ids in lists:
            self.check_ids(ids)
        return [list(ids) for ids in lists], batched

    def check_ids(self, ids: Any) -> None:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError("input_ids must be a list of ints or a list of such lists")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"input_ids must lie in [0, {self.vocab_size})")

    def check_length(self, ids: list[int], params: SamplingParams) -> None:
        """Rejects empty or over-long prompts, and max_new_tokens beyond what the context or
        the KV pool leaves: never clips it (vLLM answers a 400 naming both numbers)."""
        if not ids:
            raise ValueError("prompt is empty: it must have at least one token")
        if len(ids) >= self.context_length:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context length is {self.context_length}"
            )
        self.check_max_new_tokens(len(ids), params.max_new_tokens)
        if len(ids) + params.max_new_tokens > self.capacity_tokens:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the KV pool ({self.capacity_tokens} tokens); raise max_total_tokens"
            )

    def check_max_new_tokens(self, num_prompt: int, max_new_tokens: int) -> None:
        """Rejects a max_new_tokens that does not fit in the context after the prompt."""
        room = self.context_length - num_prompt
        if max_new_tokens > room:
            raise ValueError(
                f"max_new_tokens is {max_new_tokens} but the context length is "
                f"{self.context_length} and the prompt has {num_prompt} tokens: at most {room} "
                "tokens can be generated"
            )

    def new_spec(self, ids, params, rid, salt, logprob, index: int = 0) -> RequestSpec:
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise ValueError(f"rid must be a non-empty string; got {rid!r}")
        request_id = uuid.uuid4().hex
        base = rid if rid is not None else request_id
        seed = params.sampling_seed
        seed = self._rng.getrandbits(62) if seed is None else (seed + index) & SEED_MASK
        return RequestSpec(
            request_id=request_id,
            rid=base if params.n == 1 else f"{base}-{index}",
            input_ids=ids,
            params=params,
            seed=seed,
            namespace=salt,
            logprob_start_len=None if logprob is None else logprob.start_len,
            top_logprobs_num=0 if logprob is None else logprob.top_num,
            token_ids_logprob=list(logprob.token_ids) if logprob and logprob.token_ids else None,
        )


def salted_namespace(cache_salt: Any, extra_key: Any) -> str | None:
    """The cache namespace a request's `cache_salt` and `extra_key` name, as SGLang joins
    them: the salt followed by the key; either alone is the namespace; neither: None."""
    for name, value in (("cache_salt", cache_salt), ("extra_key", extra_key)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a string; got {value!r}"[:200])
    if cache_salt is None or extra_key is None:
        return extra_key if cache_salt is None else cache_salt
    return cache_salt + extra_key


def renamed(message: str, names: dict[str, str]) -> str:
    """`message` with each core field name (a key of `names`, as a whole word) replaced by
    the API's own name for it."""
    if not names:
        return message
    pattern = r"\b(" + "|".join(map(re.escape, names)) + r")\b"
    return re.sub(pattern, lambda match: names[match.group(1)], message)


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return value
    if value is not None and count > 1 and name == "rid":
        raise ValueError("rid must be a list with one id per prompt")
    return [value] * count


def _logprob_request(return_logprob, start_len, top_num) -> LogprobRequest | None:
    """The logprobs asked for; the options are checked even when return_logprob is false,
    so a bad value is never silently accepted."""
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob must be a boolean; got {return_logprob!r}")
    start_len = -1 if start_len is None else start_len
    top_num = 0 if top_num is None else top_num
    if not is_int64(start_len) or start_len < -1:
        raise ValueError(f"logprob_start_len must be a 64-bit int >= -1; got {start_len!r}")
    if not is_int(top_num) or not 0 <= top_num <= MAX_LOGPROBS:
        raise ValueError(f"top_logprobs_num must be an int in [0, {MAX_LOGPROBS}]; got {top_num!r}")
    if not return_logprob:
        return None
    return LogprobRequest(start_len=start_len, top_num=top_num)


def _priority(priority: Any, enabled: bool) -> int:
    if priority is None:
        return 0
    if not is_int64(priority):
        raise ValueError(f"priority must be a 64-bit int; got {priority!r}")
    if priority and not enabled:
        raise ValueError("priority needs a server started with --enable-priority-scheduling")
    return priority


def _retention_ttl(retention: Any) -> float:
    """The TTL of a `retention` object: {"ttl_s": seconds > 0}."""
    if not isinstance(retention, dict) or set(retention) != {"ttl_s"}:
        raise ValueError(f'retention must be an object {{"ttl_s": seconds}}; got {retention!r}')
    ttl = retention["ttl_s"]
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl):
        raise ValueError(f"retention.ttl_s must be a number of seconds; got {ttl!r}")
    if ttl <= 0:
        raise ValueError(f"retention.ttl_s must be > 0; got {ttl!r}")
    return float(ttl)
