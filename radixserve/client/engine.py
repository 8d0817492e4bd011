"""Engine: SGLang's offline API (generate, async_generate, flush_cache, get_stats) in-process.

Requests go through the same typed stream as the HTTP server's (client/client.py): an
`InProcessClient` runs the core on its own thread, so calls from many threads batch together.
Synchronous calls run their stream on a private event loop thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixserve.cache.retention import prefix_pin_key, session_pin_key
from radixserve.client.embedding import embed_args, encode_output, request_meta
from radixserve.client.inproc_client import InProcessClient
from radixserve.client.loop_thread import LoopThread
from radixserve.client.output import LogprobCursor, format_output
from radixserve.client.request_builder import GenerateArgs, RequestBuilder, renamed
from radixserve.client.rerank import check_text_pairs, relevances, rerank_args, rerank_mode
from radixserve.client.result import RequestResult, ResultStream
from radixserve.client.scoring import SCORE_NAMES, item_scores, score_args, scores_with_head
from radixserve.config import split_engine_kwargs
from radixserve.engine.core import EngineCore
from radixserve.engine.protocol import RequestSpec

PROGRESS_BAR_MIN_BATCH = 32


class Engine:
    """`Engine(model_path=None, **server_args)`; server_args are config dataclass fields."""

    def __init__(self, model_path: str | None = None, **server_args: Any):
        configs = split_engine_kwargs(model_path, server_args)
        self.core = EngineCore.build(*configs)
        self.model_name = self.core.loaded.name
        self.runner = self.core.runner
        self.scheduler = self.core.scheduler
        self.cache = self.core.cache
        self.tokenizer = self.core.tokenizer
        self.context_length = self.core.context_length
        self.builder = RequestBuilder(
            self.tokenizer,
            self.runner.config.vocab_size,
            self.context_length,
            self.runner.pool.capacity_tokens,
            enable_priority=self.scheduler.config.enable_priority_scheduling,
            disaggregation_mode=handoff.mode if (handoff := self.scheduler.handoff) else None,
            lora_adapters=None if self.runner.lora is None else self.runner.lora.ids,
            is_embedding=configs[0].is_embedding,
        )
        self.client = InProcessClient(self.core)
        self._loop = LoopThread()
        self._closed = False

    # ---- public API ----------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        cache_salt: str | list[str] | None = None,
        stream: bool = False,
        progress_bar: bool | None = None,
        *,
        priority: int | None = None,
        session_id: str | None = None,
        retention: dict | None = None,
        lora_path: str | list[str] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """One prompt -> one output dict; a list of prompts -> a list (n > 1: n per prompt)."""
        specs, batched = self._build(_generate_args(locals()))
        if stream:
            return self._loop.iterate(self._stream(specs, return_text_in_logprobs))
        show = len(specs) >= PROGRESS_BAR_MIN_BATCH if progress_bar is None else progress_bar
        results = self._loop.run(self._run(specs, show))
        return _shape(results, batched, return_text_in_logprobs)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        cache_salt: str | list[str] | None = None,
        stream: bool = False,
        *,
        priority: int | None = None,
        session_id: str | None = None,
        retention: dict | None = None,
        lora_path: str | list[str] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """As generate; with stream=True returns an async iterator of cumulative outputs."""
        specs, batched = self._build(_generate_args(locals()))
        if stream:
            return self._stream(specs, return_text_in_logprobs)
        results = await self._run(specs, progress_bar=False)
        return _shape(results, batched, return_text_in_logprobs)

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        cache_salt: str | list[str] | None = None,
        *,
        lora_path: str | list[str] | None = None,
        priority: int | None = None,
    ) -> dict | list[dict]:
        """SGLang's Engine.encode (an engine built with is_embedding=True): one prompt -> one
        {"embedding", "meta_info"} dict, a list of prompts -> a list (client/embedding.py)."""
        call = self.async_encode(
            prompt, input_ids, rid, cache_salt, lora_path=lora_path, priority=priority
        )
        return self._loop.run(call)

    async def async_encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        cache_salt: str | list[str] | None = None,
        *,
        lora_path: str | list[str] | None = None,
        priority: int | None = None,
    ) -> dict | list[dict]:
        """As encode."""
        args = embed_args(text=prompt, input_ids=input_ids, rid=rid, cache_salt=cache_salt,
                          lora_path=lora_path, priority=priority)  # fmt: skip
        specs, batched = self._build(args, embed=True)
        results = await self._answers(specs)
        scores = self.core.loaded.config.num_labels is not None  # a classifier: raw scores
        outputs = [encode_output(result, normalize=not scores) for result in results]
        return outputs if batched else outputs[0]

    def score(
        self,
        query: str | list[int] | None = None,
        items: str | list[str] | list[list[int]] | None = None,
        label_token_ids: list[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """SGLang's Engine.score: per item, the probability of each label token coming next
        after query + item (client/scoring.py), in the order of label_token_ids."""
        call = self.async_score(query, items, label_token_ids, apply_softmax, item_first)
        return self._loop.run(call)

    async def async_score(
        self,
        query: str | list[int] | None = None,
        items: str | list[str] | list[list[int]] | None = None,
        label_token_ids: list[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """As score."""
        classifier = scores_with_head(self.builder.is_embedding, self.core.loaded.config.num_labels)
        args = score_args(query, items, label_token_ids, item_first, classifier)
        specs, _ = self._build(args, self.builder.is_embedding, SCORE_NAMES)
        results = await self._answers(specs)
        return [item_scores(result, apply_softmax, classifier) for result in results]

    def rerank(self, prompt: list[list[str]]) -> list[dict]:
        """SGLang's Engine.rerank: each [query, document] pair's relevance (client/rerank.py:
        a generating model's yes / no judgement, a cross-encoder's sigmoid, an embedding
        model's cosine) as {"embedding": score, "meta_info"}, in pair order."""
        pairs = prompt if isinstance(prompt, list) else None
        if not pairs or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise ValueError("prompt must be a non-empty list of [query, document] pairs")
        try:
            queries, documents = check_text_pairs([p[0] for p in pairs], [p[1] for p in pairs])
        except ValueError as exc:  # text_1: the queries, text_2: the documents
            raise ValueError(f"prompt: {exc}") from exc
        mode = rerank_mode(self.builder.is_embedding, self.core.loaded.config.num_labels)
        args = rerank_args(mode, self.tokenizer, queries, documents)
        specs, _ = self._build(args, mode != "generative", {"input_ids": "prompt"})
        results = self._loop.run(self._answers(specs))
        return [{"embedding": item.score, "meta_info": request_meta(item.result)}
                for item in relevances(mode, results, len(queries))]  # fmt: skip

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Aborts the running request with this rid (or its n > 1 samples), or with
        `abort_all` every running request (SGLang's signature)."""
        if abort_all:
            self.client.abort_all()
        elif rid:
            self.client.abort_rid(rid)

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are queued or running."""
        return self._loop.run(self.client.flush_cache())

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """Loads a PEFT adapter folder while serving (SGLang's name); every adapter's folder."""
        return self._change_lora("load_lora_adapter", lora_name=lora_name, lora_path=lora_path)

    def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """Unloads an adapter (ValueError while requests of it run); the adapters left."""
        return self._change_lora("unload_lora_adapter", lora_name=lora_name)

    def _change_lora(self, method: str, **args: str) -> dict[str, str]:
        try:
            adapters = self._loop.run(self.client.call(method, **args))
        except RuntimeError as exc:  # the core's refusal, "ValueError: ..."
            raise ValueError(str(exc).removeprefix("ValueError: ")) from None
        self.builder.lora_adapters = adapters["ids"]
        return adapters["paths"]

    def get_stats(self) -> dict[str, Any]:
        return self._loop.run(self.client.stats())

    def check_integrity(self) -> None:
        """Raises unless every page is free, owned by the tree, or held by a running request."""
        self._loop.run(self.client.check_integrity())

    def list_pins(self) -> list[dict]:
        """Retention pins (sessions, pinned prefixes), oldest first: as GET /cache/sessions."""
        return self._loop.run(self.client.list_pins())

    def unpin(
        self,
        *,
        name: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> bool:
        """Ends a pinned prefix's (`name`) or a session's pin in the namespace of
        `cache_salt`; False if there is none."""
        if (name is None) == (session_id is None):
            raise ValueError("unpin: give exactly one of name or session_id")
        key = prefix_pin_key(name) if session_id is None else session_pin_key(session_id)
        return self._loop.run(self.client.unpin(key, cache_salt))

    def tree_summary(self, top_k: int = 10) -> dict:
        """The radix tree's size, depth and largest subtrees: as GET /cache/tree."""
        return self._loop.run(self.client.tree_summary(top_k))

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.close()
            self._loop.stop()
            self.core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- running requests ----------------------------------------------------------------

    def _build(
        self, args: GenerateArgs, embed: bool = False, names: dict[str, str] | None = None
    ) -> tuple[list[RequestSpec], bool]:
        """`names`: the caller's names of request fields in errors (default: the request's
        `text` is generate's `prompt`)."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        try:
            return self.builder.build(args, embed)
        except ValueError as exc:
            raise ValueError(renamed(str(exc), names or {"text": "prompt"})) from exc

    async def _run(self, specs: list[RequestSpec], progress_bar: bool) -> list[RequestResult]:
        stream = ResultStream(self.client, specs, self.tokenizer)
        bar = _progress(len(specs)) if progress_bar else None
        async with stream:
            async for _, result in stream:
                stream.settle(result)
                if bar is not None and result.finished:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return stream.results

    async def _answers(self, specs: list[RequestSpec]) -> list[RequestResult]:
        """The requests run to the end, every one answered (RuntimeError naming an abort)."""
        results = await self._run(specs, progress_bar=False)
        for result in results:
            if result.unanswered:
                raise RuntimeError(f"request {result.spec.rid} aborted: {result.finish_reason}")
        return results

    async def _stream(self, specs: list[RequestSpec], with_text: bool) -> AsyncIterator[dict]:
        """Cumulative outputs of every request that changed, as each step lands."""
        stream = ResultStream(self.client, specs, self.tokenizer)
        cursors = [LogprobCursor() for _ in specs]
        async with stream:
            async for index, result in stream:
                stream.settle(result)
                if result.output_ids or result.finished:
                    yield format_output(result, with_text, cursors[index])


def _generate_args(call: dict[str, Any]) -> GenerateArgs:
    """generate's / async_generate's arguments as the one request type: `prompt` is its text;
    the others that are no request field (stream, progress_bar, ...) stay with the call."""
    return GenerateArgs.from_fields(call, text=call["prompt"])


def _shape(results: list[RequestResult], batched: bool, with_text: bool) -> dict | list[dict]:
    """One dict for one prompt with n == 1; otherwise a list, in request order."""
    outputs = [format_output(r, with_text) for r in results]
    return outputs if batched or len(outputs) > 1 else outputs[0]


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
