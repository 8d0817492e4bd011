"""HTTP backends: how one streamed request is sent to a server and timed.

radixserve, sglang  POST /generate (SGLang's native API), cumulative `output_ids` per event,
                    `meta_info.cached_tokens`
openai              POST /v1/completions with token-id prompts and
                    `stream_options.include_usage`; cached tokens from
                    `usage.prompt_tokens_details.cached_tokens`; the answer's ids are the
                    answer's text re-tokenized, as a chat client would resend it
llama-cpp           the same against llama-cpp-python's server, with text prompts
llama-server        llama.cpp's own server: POST /completion with token ids, its tokens
                    streamed back, cached tokens from the final event's `timings.cache_n`
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from radixserve_bench.record import RequestResult


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of `data:` lines, until `data: [DONE]`."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)


def greedy_params(output_len: int) -> dict[str, Any]:
    """Sampling that makes every system produce exactly `output_len` tokens."""
    return {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}


class NativeBackend:
    """SGLang's native `/generate` (served by radixserve and SGLang)."""

    def __init__(self, url: str, name: str = "radixserve", api_key: str | None = None):
        self.url, self.name = url.rstrip("/"), name
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def payload(self, prompt: list[int], output_len: int) -> dict[str, Any]:
        return {"input_ids": prompt, "sampling_params": greedy_params(output_len), "stream": True}

    async def generate(
        self, session: aiohttp.ClientSession, prompt: list[int], output_len: int, result
    ) -> None:
        """Sends one request and records its chunks, counts and answer into `result`."""
        sent = time.perf_counter()
        body = self.payload(prompt, output_len)
        async with session.post(self.url + "/generate", json=body, headers=self.headers) as resp:
            if resp.status != 200:
                return result.fail(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            last: dict[str, Any] = {}
            async for event in sse_events(resp):
                if "error" in event:
                    return result.fail(str(event["error"]))
                self._record_chunk(result, event, time.perf_counter() - sent)
                last = event
        result.e2e = time.perf_counter() - sent
        self._record_end(result, last)

    @staticmethod
    def _record_chunk(result: RequestResult, event: dict[str, Any], elapsed: float) -> None:
        new = len(event["output_ids"]) - len(result.output_ids)
        if new > 0:
            result.add_chunk(elapsed, new)
            result.output_ids = list(event["output_ids"])

    @staticmethod
    def _record_end(result: RequestResult, last: dict[str, Any]) -> None:
        if not last:
            return result.fail("empty stream")
        meta = last["meta_info"]
        result.prompt_len = meta["prompt_tokens"]
        result.output_len = meta["completion_tokens"]
        result.cached_tokens = meta.get("cached_tokens") or 0
        result.success = True

    async def prepare(self, session: aiohttp.ClientSession) -> None:
        """Nothing to look up: the native API takes no model name."""

    async def flush_cache(self, session: aiohttp.ClientSession) -> bool:
        async with session.post(self.url + "/flush_cache", headers=self.headers) as resp:
            return resp.status == 200

    async def server_info(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(self.url + "/server_info", headers=self.headers) as resp:
            return await resp.json() if resp.status == 200 else {}


class OpenAIBackend:
    """Any OpenAI-compatible server's `/v1/completions` (vLLM, SGLang, llama.cpp, ours)."""

    name = "openai"

    def __init__(self, url: str, tokenizer, model: str | None = None, api_key: str | None = None):
        self.url, self.tokenizer, self.model = url.rstrip("/"), tokenizer, model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def payload(self, prompt: list[int], output_len: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def generate(
        self, session: aiohttp.ClientSession, prompt: list[int], output_len: int, result
    ) -> None:
        """Sends one request; each chunk with text counts as one token's arrival."""
        sent = time.perf_counter()
        url, body = self.url + "/v1/completions", self.payload(prompt, output_len)
        text, usage = "", None
        async with session.post(url, json=body, headers=self.headers) as resp:
            if resp.status != 200:
                return result.fail(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for event in sse_events(resp):
                if "error" in event:
                    return result.fail(str(event["error"]))
                delta = "".join(c.get("text") or "" for c in event.get("choices") or [])
                if delta:
                    result.add_chunk(time.perf_counter() - sent, 1)
                    text += delta
                usage = event.get("usage") or usage
        result.e2e = time.perf_counter() - sent
        self._record_end(result, text, usage, len(prompt))

    def _record_end(self, result: RequestResult, text: str, usage, prompt_len: int) -> None:
        result.output_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        result.prompt_len = usage.get("prompt_tokens", prompt_len)
        result.output_len = usage.get("completion_tokens", sum(result.chunk_tokens))
        result.cached_tokens = details.get("cached_tokens") or 0
        result.success = True

    async def prepare(self, session: aiohttp.ClientSession) -> None:
        """Picks the server's first model when none was named."""
        if self.model is None:
            async with session.get(self.url + "/v1/models", headers=self.headers) as resp:
                self.model = (await resp.json())["data"][0]["id"]

    async def flush_cache(self, session: aiohttp.ClientSession) -> bool:
        """No standard endpoint: tries SGLang's / radixserve's, then vLLM's."""
        for path in ("/flush_cache", "/reset_prefix_cache"):
            async with session.post(self.url + path, headers=self.headers) as resp:
                if resp.status == 200:
                    return True
        return False

    async def server_info(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        return {"model": self.model}


class LlamaCppBackend(OpenAIBackend):
    """llama-cpp-python's OpenAI server: text prompts only (it takes no token ids), EOS held
    off by `min_tokens`, and llama.cpp's default repeat penalty turned off for plain greedy."""

    name = "llama-cpp"

    def payload(self, prompt: list[int], output_len: int) -> dict[str, Any]:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        extra = {"prompt": text, "min_tokens": output_len, "repeat_penalty": 1.0}
        return super().payload(prompt, output_len) | extra


class LlamaServerBackend:
    """llama.cpp's own server (`llama-server`) through its native `/completion`: token-id
    prompts, greedy with EOS ignored, each streamed event carrying its token id, and the final
    event (`stop: true`) its `timings`: `cache_n` prompt tokens reused from the slot's cache,
    `prompt_n` prefilled, `predicted_n` generated."""

    name = "llama-server"

    def __init__(self, url: str, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def payload(self, prompt: list[int], output_len: int) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "n_predict": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": True,
            "return_tokens": True,
            "stream": True,
        }

    async def generate(
        self, session: aiohttp.ClientSession, prompt: list[int], output_len: int, result
    ) -> None:
        """Sends one request and records its tokens, timings and counts into `result`."""
        sent = time.perf_counter()
        body = self.payload(prompt, output_len)
        final: dict[str, Any] = {}
        async with session.post(self.url + "/completion", json=body, headers=self.headers) as resp:
            if resp.status != 200:
                return result.fail(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for event in sse_events(resp):
                if "error" in event:
                    return result.fail(str(event["error"]))
                if tokens := event.get("tokens"):
                    result.add_chunk(time.perf_counter() - sent, len(tokens))
                    result.output_ids += tokens
                if event.get("stop"):
                    final = event
        result.e2e = time.perf_counter() - sent
        record_llama_server_end(result, final, len(prompt))

    async def prepare(self, session: aiohttp.ClientSession) -> None:
        """Nothing to look up: /completion takes no model name."""

    async def flush_cache(self, session: aiohttp.ClientSession) -> bool:
        """No endpoint empties both its slots and its RAM prompt cache; the warm-up prompts
        share no prefix with the workload's, so what they leave cannot raise its hit rate."""
        return False

    async def server_info(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(self.url + "/props", headers=self.headers) as resp:
            if resp.status != 200:
                return {}
            props = await resp.json()
        keys = ("total_slots", "build_info", "model_path")
        return {k: props[k] for k in keys if k in props}


def record_llama_server_end(result: RequestResult, final: dict[str, Any], prompt_len: int) -> None:
    """Counts from llama-server's final event; a stream without one failed."""
    if not final:
        return result.fail("stream ended without llama-server's final event")
    timings = final.get("timings") or {}
    result.prompt_len = final.get("tokens_evaluated", prompt_len)
    result.output_len = timings.get("predicted_n", len(result.output_ids))
    result.cached_tokens = timings.get("cache_n") or 0
    result.success = True


BACKENDS = ("radixserve", "sglang", "openai", "llama-cpp", "llama-server")


def make_backend(name: str, url: str, tokenizer, model: str | None, api_key: str | None):
    """The backend called `name` for the server at `url`."""
    if name in ("radixserve", "sglang"):
        return NativeBackend(url, name, api_key)
    if name == "openai":
        return OpenAIBackend(url, tokenizer, model, api_key)
    if name == "llama-cpp":
        return LlamaCppBackend(url, tokenizer, model, api_key)
    if name == "llama-server":
        return LlamaServerBackend(url, api_key)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
