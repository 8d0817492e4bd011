"""EngineClient: the one way callers reach an engine core, in-process or in another process.

    client.submit(specs) -> OutputStream      (index, RequestOutput) deltas until all finish
    client.generate(spec)                     one request's deltas
    client.abort(request_ids), abort_rid(rid), flush_cache(), stats(), check_integrity()

Requests are routed by their internal `request_id`, never by the caller's `rid`: a stream
that is closed early (client gone, cancelled) aborts its requests and forgets them at once,
so a new request reusing the rid never sees the old one's tokens. A rid may belong to one
running request at a time. If the core dies, every stream raises `EngineDeadError` and so
does every later call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixserve.engine.protocol import (
    AbortRequests,
    AddRequests,
    Call,
    CallResult,
    RequestOutput,
    RequestSpec,
)


class EngineDeadError(RuntimeError):
    """The engine core exited or failed: nothing can run until the server is restarted."""


class EngineBusyError(RuntimeError):
    """More requests than the client admits (running + queued limit): retry later."""


class OutputStream:
    """Deltas of requests submitted together, as (index, RequestOutput), until all finished.

    Closing it before then (`aclose`, or leaving `async with`) aborts the unfinished ones.
    """

    def __init__(self, client: EngineClient, specs: list[RequestSpec]):
        self.client = client
        self.specs = specs
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self.unfinished = set(range(len(specs)))

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        if item[1].finish_reason is not None:
            self.unfinished.discard(item[0])
        return item

    async def aclose(self) -> None:
        self._abort(list(self.unfinished))

    def abort_one(self, index: int) -> None:
        """Aborts one request of the stream (if still unfinished) and stops routing it."""
        self._abort([index] if index in self.unfinished else [])

    def _abort(self, indices: list[int]) -> None:
        if indices:
            ids = [self.specs[i].request_id for i in indices]
            self.unfinished.difference_update(indices)
            self.client.forget(ids)
            self.client.abort(ids)

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class EngineClient(ABC):
    """Submits requests to an engine core and routes its deltas to their streams."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the registry is read by the core's delivering thread
        self._streams: dict[str, tuple[OutputStream, int]] = {}  # request_id -> (stream, index)
        # (namespace, rid) -> request_id of the running request: a rid is unique within its
        # tenant's namespace only, so one tenant can neither block nor abort another's rids
        self._rids: dict[tuple[str | None, str], str] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self.dead_reason: str | None = None
        self.on_dead: list[Callable[[str], None]] = []

    # ---- what an implementation provides -------------------------------------------------

    @abstractmethod
    def _send(self, message: AddRequests | AbortRequests | Call) -> None:
        """Hands a message to the core (any thread)."""

    @abstractmethod
    def close(self) -> None: ...

    # ---- requests ------------------------------------------------------------------------

    @property
    def dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def active_request_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def submit(self, specs: list[RequestSpec], max_active: int | None = None) -> OutputStream:
        """Registers and sends `specs` at once (no await between the capacity check and the
        registration). Raises ValueError for a rid in use, EngineBusyError past `max_active`."""
        stream = OutputStream(self, specs)
        with self._lock:
            self._check_submit(specs, max_active)
            for index, spec in enumerate(specs):
                self._streams[spec.request_id] = (stream, index)
                self._rids[(spec.namespace, spec.rid)] = spec.request_id
        try:
            self._send(AddRequests(specs))
        except BaseException:  # never sent: nothing will finish them, so unregister them now
            self.forget([spec.request_id for spec in specs])
            raise
        return stream

    def _check_submit(self, specs: list[RequestSpec], max_active: int | None) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if max_active is not None and len(self._streams) + len(specs) > max_active:
            raise EngineBusyError("too many queued requests; retry later")
        keys = [(spec.namespace, spec.rid) for spec in specs]
        for key in keys:
            if key in self._rids or keys.count(key) > 1:
                raise ValueError(f"rid {key[1]!r} is already in use by a running request")

    async def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        """One request's deltas; closing the iterator early aborts the request."""
        async with self.submit([spec]) as stream:
            async for _, output in stream:
                yield output

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead:
            self._send(AbortRequests(list(request_ids)))

    def abort_rid(self, rid: str, namespaces: list[str | None] | None = None) -> int:
        """Aborts the running request with this rid, or with rids `rid-0, rid-1, ...` (n > 1
        samples), in `namespaces` only (None: in every namespace); returns how many."""
        with self._lock:
            ids = [
                request_id
                for (namespace, r), request_id in self._rids.items()
                if (r == rid or _is_sample_of(r, rid))
                and (namespaces is None or namespace in namespaces)
            ]
        self.abort(ids)
        return len(ids)

    def abort_all(self, namespaces: list[str | None] | None = None) -> int:
        """Aborts every running request in `namespaces` (None: in every namespace), as
        SGLang's `abort_all`; returns how many."""
        with self._lock:
            ids = [
                request_id
                for request_id, (stream, index) in self._streams.items()
                if namespaces is None or stream.specs[index].namespace in namespaces
            ]
        self.abort(ids)
        return len(ids)

    def forget(self, request_ids: list[str]) -> None:
        """Stops routing these requests' deltas (their stream is gone)."""
        with self._lock:
            for request_id in request_ids:
                entry = self._streams.pop(request_id, None)
                if entry is not None:
                    spec = entry[0].specs[entry[1]]
                    self._rids.pop((spec.namespace, spec.rid), None)

    # ---- calls ---------------------------------------------------------------------------

    async def call(self, method: str, timeout_s: float = 30.0, **args: Any) -> Any:
        """Runs `method(**args)` on the core between steps; its result, or RuntimeError."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._send(Call(call_id, method, args))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    async def flush_cache(self) -> bool:
        return await self.call("flush_cache")

    async def stats(self) -> dict[str, Any]:
        return await self.call("get_stats")

    async def check_integrity(self) -> None:
        await self.call("check_integrity")

    async def list_pins(self) -> list[dict]:
        return await self.call("list_pins")

    async def unpin(self, key: str, namespace: str | None = None) -> bool:
        return await self.call("unpin", key=key, namespace=namespace)

    async def tree_summary(self, top_k: int = 10, namespaces: list | None = None) -> dict:
        """Size and shape of the tree; largest subtrees of `namespaces` only (None: all)."""
        return await self.call("tree_summary", top_k=top_k, namespaces=namespaces)

    # ---- what the core sends back (any thread) -------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Routes a step's deltas to their streams, each on its own event loop."""
        batches: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            for output in outputs:
                entry = self._streams.get(output.request_id)
                if entry is None:
                    continue  # its stream is gone
                stream, index = entry
                if output.finish_reason is not None:
                    del self._streams[output.request_id]
                    spec = stream.specs[index]
                    self._rids.pop((spec.namespace, spec.rid), None)
                batches[stream.loop].append((stream.queue, (index, output)))
        for loop, items in batches.items():
            _call_on(loop, _put_all, items)

    def _resolve(self, result: CallResult) -> None:
        with self._lock:
            future = self._calls.get(result.call_id)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.value)

    def _fail_all(self, reason: str) -> None:
        """The core is gone: every stream and call fails with EngineDeadError."""
        with self._lock:
            if self.dead_reason is not None:
                return
            self.dead_reason = reason
            streams = {stream for stream, _ in self._streams.values()}
            self._streams.clear()
            self._rids.clear()
            calls = list(self._calls.values())
        for stream in streams:
            _call_on(stream.loop, stream.queue.put_nowait, EngineDeadError(reason))
        for future in calls:
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for callback in self.on_dead:
            callback(reason)


def _is_sample_of(rid: str, base: str) -> bool:
    head, _, index = rid.rpartition("-")
    return head == base and index.isdigit()


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _call_on(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """Runs `fn(*args)` on `loop`: directly when already on it, else thread-safely."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn(*args)
    elif not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)
