"""Engine: SGLang's offline API (generate, async_generate, flush_cache, get_stats) in-process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.config import split_engine_kwargs
from radixserve.engine.core import EngineCore
from radixserve.engine.output import format_output
from radixserve.engine.request import Req
from radixserve.engine.request_builder import GenerateArgs, RequestBuilder

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
        )
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-step")
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
    ) -> dict | list[dict] | Iterator[dict]:
        """One prompt -> one output dict; a list of prompts -> a list (n > 1: n per prompt)."""
        reqs, batched = self.builder.build(
            GenerateArgs(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                         top_logprobs_num, rid, cache_salt)
        )  # fmt: skip
        if stream:
            return self._stream(reqs, return_text_in_logprobs)
        self._submit(reqs)
        self._run_until_finished(reqs, progress_bar)
        return self._outputs(reqs, batched, return_text_in_logprobs)

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
        reqs, batched = self.builder.build(
            GenerateArgs(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                         top_logprobs_num, rid, cache_salt)
        )  # fmt: skip
        if stream:
            return self._async_stream(reqs, return_text_in_logprobs)
        self._submit(reqs)
        loop = asyncio.get_running_loop()
        while not all(r.finished for r in reqs):
            await loop.run_in_executor(self._executor, self._step)
        return self._outputs(reqs, batched, return_text_in_logprobs)

    def _outputs(self, reqs: list[Req], batched: bool, with_text: bool) -> dict | list[dict]:
        """One dict for one prompt with n == 1; otherwise a list, in request order."""
        outputs = [format_output(r, self.tokenizer, with_text) for r in reqs]
        return outputs if batched or len(outputs) > 1 else outputs[0]

    def abort_request(self, rid: str) -> None:
        self.scheduler.abort_request(rid)

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are queued or running."""
        with self._lock:
            return self.core.flush_cache()

    def get_stats(self) -> dict[str, Any]:
        return self.core.get_stats()

    def check_integrity(self) -> None:
        """Raises unless every page is free, owned by the tree, or held by a running request."""
        with self._lock:
            self.core.check_integrity()

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
        seen: dict[int, tuple] = {}
        try:
            while True:
                yield from self._progressed(reqs, seen, with_text)
                if all(r.finished for r in reqs):
                    return
                self._step()
        finally:
            self._abort_unfinished(reqs)

    async def _async_stream(self, reqs: list[Req], with_text: bool) -> AsyncIterator[dict]:
        self._submit(reqs)
        loop = asyncio.get_running_loop()
        seen: dict[int, tuple] = {}
        try:
            while True:
                for output in self._progressed(reqs, seen, with_text):
                    yield output
                if all(r.finished for r in reqs):
                    return
                await loop.run_in_executor(self._executor, self._step)
        finally:
            self._abort_unfinished(reqs)

    def _progressed(self, reqs: list[Req], seen: dict[int, tuple], with_text: bool):
        """Outputs of the requests that gained tokens or finished since last seen, whichever
        thread's step advanced them (several threads may drive one engine)."""
        for req in reqs:
            state = (len(req.output_ids), req.finished)
            if seen.get(id(req)) != state and (state[0] or req.finished):
                seen[id(req)] = state
                yield format_output(req, self.tokenizer, with_text)

    def _abort_unfinished(self, reqs: list[Req]) -> None:
        for req in reqs:
            if not req.finished:
                self.abort_request(req.rid)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
