"""NGRAM speculation's counts over HTTP, on conftest's `periodic_model`: the native /generate
reports them in meta_info and /metrics exports them; the OpenAI endpoints take the
`speculative` opt-out and keep the counts out of usage; the counts cross the core pipe."""

from __future__ import annotations

import asyncio

import pytest
from speculative_common import NGRAM

from conftest import greedy, make_engine, prompt_ids


def test_http_generate_reports_spec_meta_info_and_metrics(periodic_model):
    """The native /generate handler and /metrics over an in-process engine (a server
    subprocess would cost ~20 s to start here); the core pipe's codec is checked below."""
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from radixserve.server.app import build_app

    engine = make_engine(periodic_model, speculative_num_draft_tokens=3, **NGRAM)
    state = _server_state(engine, periodic_model)
    body = {"input_ids": prompt_ids(4, 40), "sampling_params": greedy(30)}

    async def run():
        async with TestClient(TestServer(build_app(state))) as client:
            generated = await (await client.post("/generate", json=body)).json()
            bad = body | {"sampling_params": {"speculative": 1}}
            rejected = await client.post("/generate", json=bad)
            metrics = await (await client.get("/metrics")).text()
            return generated, (rejected.status, await rejected.text()), metrics

    out, (status, error), text = asyncio.run(run())
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 30 and meta["spec_accept_token_num"] > 0
    assert meta["spec_accept_length"] == pytest.approx(30 / meta["spec_verify_ct"])
    assert meta["spec_draft_token_num"] <= 3 * meta["spec_verify_ct"]
    assert sum(meta["spec_drafter_verify_ct"].values()) == meta["spec_verify_ct"]
    assert meta["spec_drafter_verify_ct"]["NGRAM"] > 0  # the steps NGRAM drafted
    assert status == 400 and "speculative" in error
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["radixserve:spec_accepted_tokens_total"] == meta["spec_accept_token_num"]
    assert values["radixserve:spec_verify_steps_total"] == meta["spec_verify_ct"]
    assert values["radixserve:spec_draft_tokens_total"] == meta["spec_draft_token_num"]
    assert values["radixserve:spec_accept_length"] > 1


def test_openai_endpoints_take_the_opt_out_and_stay_free_of_spec_counts(periodic_model):
    """`speculative` is an extra body field of both OpenAI endpoints (false: no verify step
    counted); the counts stay native-only, as in SGLang and vLLM (usage has none)."""
    from aiohttp.test_utils import TestClient, TestServer

    from radixserve.server.app import build_app

    engine = make_engine(periodic_model, **NGRAM)
    state = _server_state(engine, periodic_model)
    completion = {"prompt": prompt_ids(4, 40), "max_tokens": 20, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}

    async def post(client, path, body):
        before = engine.get_stats()["spec_verify_steps"]
        response = await client.post(path, json=body)
        counted = engine.get_stats()["spec_verify_steps"] - before
        return response.status, await response.json(), counted

    async def run():
        async with TestClient(TestServer(build_app(state))) as client:
            results = {}
            for name, path, body in [
                ("completion", "/v1/completions", completion),
                ("chat", "/v1/chat/completions", chat),
            ]:
                results[name, True] = await post(client, path, body)
                results[name, False] = await post(client, path, body | {"speculative": False})
                results[name, "bad"] = await post(client, path, body | {"speculative": "no"})
            return results

    results = asyncio.run(run())
    for name in ("completion", "chat"):
        (status_on, on, steps_on), (status_off, off, steps_off) = (
            results[name, True],
            results[name, False],
        )
        assert status_on == status_off == 200
        assert steps_on > 0 and steps_off == 0  # verify steps: the speculating request's only
        assert (
            on["choices"][0]["text" if name == "completion" else "message"]
            == off["choices"][0]["text" if name == "completion" else "message"]
        )
        assert not any("spec" in key for key in on["usage"])
        status, error, _ = results[name, "bad"]
        assert status == 400 and "speculative" in error["error"]["message"]


def test_spec_counts_cross_the_core_pipe():
    from radixserve.engine.protocol import RequestOutput, SpecCounts, StepOutputs
    from radixserve.engine.wire import decode_from_core, encode

    counts = SpecCounts(3, 8, 5, {"SUFFIX": 2, "none": 1}, {"SUFFIX": 5, "none": 0})
    sent = StepOutputs([RequestOutput("a", [1, 2], spec_counts=counts)])
    assert decode_from_core(encode(sent)) == sent


def _server_state(engine, model_path: str):
    """The HTTP app's state over an in-process engine (no server process)."""
    from radixserve.config import ServerConfig
    from radixserve.server.metrics import ServerMetrics
    from radixserve.server.state import ServerState

    return ServerState(
        client=engine.client,
        builder=engine.builder,
        tokenizer=engine.tokenizer,
        config=ServerConfig(),
        engine_args={},
        model_path=model_path,
        served_model_name="periodic",
        max_running_requests=256,
        metrics=ServerMetrics(),
    )
