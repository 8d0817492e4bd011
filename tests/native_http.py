"""HTTP calls on SGLang's native API that the server tests share (aiohttp, one session per
call): POST and GET answering (status, JSON or text), a streamed /generate's events, and
`run` for driving a coroutine from a test."""

from __future__ import annotations

import asyncio
import json

import aiohttp

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
JSON_TYPE = {"Content-Type": "application/json"}


async def post(url: str, body, **kwargs):
    """POSTs `body` (raw if bytes or str, else as JSON) as Content-Type: application/json."""
    kwargs["headers"] = JSON_TYPE | kwargs.get("headers", {})
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with session.post(url, data=data, **kwargs) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text.startswith(("{", "[")) else text)


async def get(url: str, **kwargs):
    async with aiohttp.ClientSession() as session:
        async with session.get(url, **kwargs) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text.startswith(("{", "[")) else text)


async def stream_generate(url: str, body) -> list:
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=body | {"stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def run(coro):
    return asyncio.run(coro)
