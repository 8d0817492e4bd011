"""What the disaggregation tests (tests/test_disagg_*.py) share: in-process cores in a PD mode,
requests carrying the bootstrap fields sglang-router's PD mode would set, stepping cores until
their requests finish, and the check that no page leaked."""

from __future__ import annotations

import itertools
import time

import torch

from conftest import greedy, make_core
from radixserve.engine.protocol import Bootstrap, RequestSpec
from radixserve.engine.request import Req
from radixserve.sampling.params import SamplingParams

PAGE = 16
HOST = "127.0.0.1"
rooms = itertools.count(1000)
"""Fresh numbers: a bootstrap room for each PD pair, a request id for each request."""

torch.set_num_threads(1)


def core(model, mode: str | None = None, **kwargs):
    flags = {"disaggregation_mode": mode or "null", "disaggregation_bootstrap_port": 0}
    return make_core(model, page_size=PAGE, **(flags | kwargs))


def request(ids, room: int | None = None, port: int | None = None, max_new_tokens=8) -> Req:
    bootstrap = None if room is None else Bootstrap(HOST, port, room)
    spec = RequestSpec(
        request_id=f"r{next(rooms)}",
        rid="r",
        input_ids=list(ids),
        params=SamplingParams.from_dict(greedy(max_new_tokens)),
        seed=0,
        bootstrap=bootstrap,
    )
    return Req.from_spec(spec)


def run(cores, reqs, timeout_s: float = 30.0) -> None:
    """Steps every core until every request finished (the decode side's fetch runs on its
    own thread meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not all(r.finished for r in reqs):
        assert time.monotonic() < deadline, [r.state for r in reqs]
        progressed = False
        for c in cores:
            c.scheduler.step()
            progressed |= c.scheduler.last_step_progressed
        if not progressed:
            time.sleep(0.002)


def submit_pair(prefill, decode, ids, **kwargs) -> tuple[Req, Req]:
    """The same prompt to both sides under one fresh room."""
    room, port = next(rooms), prefill.scheduler.handoff.bootstrap_port
    p, d = request(ids, room, port, **kwargs), request(ids, room, port, **kwargs)
    prefill.scheduler.add_request(p)
    decode.scheduler.add_request(d)
    return p, d


def assert_balanced(*cores) -> None:
    """No page leaked: the accounting holds, and flushing the tree frees every page."""
    for c in cores:
        assert not c.scheduler.has_work()
        c.check_integrity()
        assert c.flush_cache()
        allocator = c.runner.pool.allocator
        assert allocator.num_free == allocator.capacity
