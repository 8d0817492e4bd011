"""Engine: SGLang's offline API (generate, async_generate, flush_cache, get_stats) in-process."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.cache.radix_cache import create_prefix_cache
from radixserve.config import split_engine_kwargs
from radixserve.engine.output import format_output
from radixserve.engine.request import LogprobRequest, Req
from radixserve.engine.scheduler import Scheduler
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner
from radixserve.model.tokenizer import load_tokenizer
from radixserve.sampling.params import SamplingParams

PROGRESS_BAR_MIN_BATCH = 32


class Engine:
    """`Engine(model_path=None, **server_args)`; server_args are config dataclass fields."""

    def __init__(self, model_path: str | None = None, **server_args: Any):
        load_config, cache_config, self.scheduler_config = split_engine_kwargs(
            model_path, server_args
        )
        loaded = load_model(load_config)
        self.model_name = loaded.name
        self.runner = ModelRunner.from_loaded(loaded, load_config, cache_config)
        self.tokenizer = load_tokenizer(loaded)
        self.cache = create_prefix_cache(
            self.scheduler_config.disable_radix_cache,
            self.runner.pool.allocator,
            self.runner.pool.page_size,
        )
        self.scheduler = Scheduler(
            self.runner, self.cache, self.scheduler_config, self._eos_ids(loaded), self.tokenizer
        )
        self.context_length = (
            self.scheduler_config.context_length or loaded.config.max_position_embeddings
        )
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-step")
        self._rng = random.Random()
        self._next_rid = 0
        self._closed = False

    def _eos_ids(self, loaded) -> tuple[int, ...]:
        ids = set(loaded.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

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
    ) -> dict | list[dict] | Iterator[dict]:
        """One prompt -> one output dict; a list of prompts -> a list (n > 1: n per prompt)."""
        reqs, batched = self._make_requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
            top_logprobs_num, rid, cache_salt,
        )  # fmt: skip
        if stream:
            return self._stream(reqs, return_text_in_logprobs)
        self._submit(reqs)
        self._run_until_finished(reqs, progress_bar)
        outputs = [format_output(r, self.tokenizer, return_text_in_logprobs) for r in reqs]
        return outputs if batched or len(outputs) > 1 else outputs[0]

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
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """As generate; with stream=True returns an async iterator of cumulative outputs."""
        reqs, batched = self._make_requests(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
            top_logprobs_num, rid, cache_salt,
        )  # fmt: skip
        if stream:
            return self._async_stream(reqs, return_text_in_logprobs)
        self._submit(reqs)
        loop = asyncio.get_running_loop()
        while not all(r.finished for r in reqs):
            await loop.run_in_executor(self._executor, self._step)
        outputs = [format_output(r, self.tokenizer, return_text_in_logprobs) for r in reqs]
        return outputs if batched or len(outputs) > 1 else outputs[0]

    def abort_request(self, rid: str) -> None:
        self.scheduler.abort_request(rid)

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are queued or running."""
        with self._lock:
            if self.scheduler.has_work():
                return False
            self.cache.reset()
            return True

    def get_stats(self) -> dict[str, Any]:
        pool = self.runner.pool
        tree = self.cache.size_info()
        return {
            "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": len(self.scheduler.waiting) + len(self.scheduler.inbox),
            "page_size": pool.page_size,
            "pool_capacity_pages": pool.allocator.capacity,
            "pool_free_pages": pool.allocator.num_free,
            "tree_pages": tree.total_pages,
            "tree_evictable_pages": tree.evictable_pages,
            "tree_protected_pages": tree.protected_pages,
            "new_token_ratio": self.scheduler.new_token_ratio,
            **self.scheduler.stats.as_dict(),
        }

    def check_integrity(self) -> None:
        """Raises unless every page is free, owned by the tree, or held by a running request."""
        with self._lock:
            self.cache.check_integrity(self.scheduler.held_pages())

    def shutdown(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- driving the scheduler -----------------------------------------------------------

    def _submit(self, reqs: list[Req]) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")
        for req in reqs:
            self.scheduler.add_request(req)

    def _step(self) -> list[Req]:
        with self._lock:
            return self.scheduler.step()

    def _run_until_finished(self, reqs: list[Req], progress_bar: bool | None) -> None:
        show = len(reqs) >= PROGRESS_BAR_MIN_BATCH if progress_bar is None else progress_bar
        bar = _progress(len(reqs)) if show else None
        done = 0
        while done < len(reqs):
            self._step()
            now = sum(r.finished for r in reqs)
            if bar is not None:
                bar.update(now - done)
            done = now
        if bar is not None:
            bar.close()

    def _stream(self, reqs: list[Req], with_text: bool) -> Iterator[dict]:
        self._submit(reqs)
        try:
            while not all(r.finished for r in reqs):
                changed = self._step()
                for req in reqs:
                    if req in changed:
                        yield format_output(req, self.tokenizer, with_text)
        finally:
            for req in reqs:
                if not req.finished:
                    self.abort_request(req.rid)

    async def _async_stream(self, reqs: list[Req], with_text: bool) -> AsyncIterator[dict]:
        self._submit(reqs)
        loop = asyncio.get_running_loop()
        try:
            while not all(r.finished for r in reqs):
                changed = await loop.run_in_executor(self._executor, self._step)
                for req in reqs:
                    if req in changed:
                        yield format_output(req, self.tokenizer, with_text)
        finally:
            for req in reqs:
                if not req.finished:
                    self.abort_request(req.rid)

    # ---- request construction ------------------------------------------------------------

    def _make_requests(
        self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
        top_logprobs_num, rid, cache_salt,
    ) -> tuple[list[Req], bool]:  # fmt: skip
        token_lists, batched = self._token_lists(prompt, input_ids)
        params_list = _per_prompt(sampling_params, len(token_lists), "sampling_params")
        rids = _per_prompt(rid, len(token_lists), "rid")
        salts = _per_prompt(cache_salt, len(token_lists), "cache_salt")
        logprob = _logprob_request(return_logprob, logprob_start_len, top_logprobs_num)
        reqs = []
        for ids, params_dict, req_rid, salt in zip(token_lists, params_list, rids, salts):
            params = SamplingParams.from_dict(params_dict)
            params.verify(self.runner.config.vocab_size)
            self._check_length(ids, params)
            for i in range(params.n):
                reqs.append(self._new_req(ids, params, req_rid, salt, logprob, i))
        return reqs, batched

    def _token_lists(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("provide exactly one of prompt or input_ids")
        if prompt is not None:
            batched = isinstance(prompt, list)
            texts = prompt if batched else [prompt]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a non-empty list of strings")
            return [self.tokenizer.encode(t) for t in texts], batched
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        lists = input_ids if batched else [input_ids]
        vocab = self.runner.config.vocab_size
        for ids in lists:
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("input_ids must be a list of ints or a list of such lists")
            if any(t < 0 or t >= vocab for t in ids):
                raise ValueError(f"input_ids must lie in [0, {vocab})")
        return [list(ids) for ids in lists], batched

    def _check_length(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty: it must have at least one token")
        if len(ids) >= self.context_length:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context length is {self.context_length}"
            )
        params.max_new_tokens = min(params.max_new_tokens, self.context_length - len(ids))
        capacity = self.runner.pool.capacity_tokens
        if len(ids) + params.max_new_tokens > capacity:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the KV pool ({capacity} tokens); raise max_total_tokens"
            )

    def _new_req(self, ids, params, rid, salt, logprob, index) -> Req:
        self._next_rid += 1
        base = rid if rid is not None else f"req-{self._next_rid}"
        seed = params.sampling_seed
        seed = self._rng.getrandbits(62) if seed is None else seed + index
        return Req(
            rid=base if params.n == 1 else f"{base}-{index}",
            input_ids=ids,
            params=params,
            seed=seed,
            namespace=salt,
            logprob=logprob,
        )


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return value
    if value is not None and count > 1 and name == "rid":
        raise ValueError("rid must be a list with one id per prompt")
    return [value] * count


def _logprob_request(return_logprob, start_len, top_num) -> LogprobRequest | None:
    if not return_logprob:
        return None
    start_len = -1 if start_len is None else start_len
    top_num = 0 if top_num is None else top_num
    if not isinstance(start_len, int) or start_len < -1:
        raise ValueError(f"logprob_start_len must be an int >= -1; got {start_len!r}")
    if not isinstance(top_num, int) or top_num < 0:
        raise ValueError(f"top_logprobs_num must be an int >= 0; got {top_num!r}")
    return LogprobRequest(start_len=start_len, top_num=top_num)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
