"""`radixserve serve` in a subprocess (conftest's shared `server`): SGLang's native /generate
(single, batch, streamed, logprobs, concurrent streams, a disconnect), its bounds and seeds,
the joined-forks call, the info endpoints and /metrics."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from native_http import GREEDY, get, post, run, stream_generate
from prometheus_client.parser import text_string_to_metric_families

import radixserve
from conftest import prompt_ids


def test_generate_single_batch_and_null_fields(server):
    body = {"input_ids": prompt_ids(1), "sampling_params": GREEDY | {"regex": None, "stop": None}}
    status, single = run(post(server.url + "/generate", body))
    assert status == 200 and len(single["output_ids"]) == 8
    keys = {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}
    assert set(single["meta_info"]) >= keys | {"e2e_latency"}
    body = {"text": ["Hello there", "General"], "sampling_params": GREEDY}
    status, batch = run(post(server.url + "/generate", body))
    assert status == 200 and isinstance(batch, list) and len(batch) == 2
    assert all(isinstance(o["text"], str) for o in batch)


def test_stream_is_cumulative_and_ends_with_done(server):
    body = {"input_ids": prompt_ids(2), "sampling_params": GREEDY}
    events = run(stream_generate(server.url, body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    _, whole = run(post(server.url + "/generate", body))
    assert chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_logprob_layout_and_prefill_only(server):
    ids = prompt_ids(3, 20)
    body = {
        "input_ids": ids,
        "sampling_params": GREEDY | {"max_new_tokens": 3},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "token_ids_logprob": [ids[4], 77],
    }
    _, out = run(post(server.url + "/generate", body))
    meta = out["meta_info"]
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == 20
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    picked = meta["input_token_ids_logprobs"]  # SGLang's: per position, the asked ids in order
    assert picked[0] is None and picked[4][0][1] == ids[4]
    assert picked[4][0][0] == pytest.approx(meta["input_token_logprobs"][4][0], abs=1e-5)
    assert [[e[1] for e in row] for row in meta["output_token_ids_logprobs"]] == [[ids[4], 77]] * 3
    events = [e for e in run(stream_generate(server.url, body)) if isinstance(e, dict)]
    streamed = [row for e in events for row in e["meta_info"]["output_token_ids_logprobs"]]
    assert len(streamed) == 3  # each chunk carries only its new positions, as SGLang's
    status, bad = run(post(server.url + "/generate", body | {"token_ids_logprob": [10**6]}))
    assert status == 400 and bad["error"]["param"] == "token_ids_logprob"
    prefix = prompt_ids(4, 48)
    body = {"input_ids": prefix, "sampling_params": {"max_new_tokens": 0}}
    _, cached = run(post(server.url + "/generate", body))
    assert cached["output_ids"] == []
    body = {"input_ids": prefix + [7, 8, 9], "sampling_params": GREEDY}
    _, hit = run(post(server.url + "/generate", body))
    assert hit["meta_info"]["cached_tokens"] == 48


def test_64_concurrent_streams_match_their_solo_outputs(server):
    bodies = [
        {"input_ids": prompt_ids(100 + i, 12 + i % 7), "sampling_params": GREEDY} for i in range(64)
    ]

    async def solo():
        return [(await post(server.url + "/generate", b))[1]["output_ids"] for b in bodies[:8]]

    async def together():
        return await asyncio.gather(*(stream_generate(server.url, b) for b in bodies))

    alone = run(solo())
    streams = run(together())
    assert all(s[-1] == "[DONE]" for s in streams)
    assert [s[-2]["output_ids"] for s in streams[:8]] == alone
    assert all(len(s[-2]["output_ids"]) == 8 for s in streams)


def test_disconnect_mid_stream_frees_pages(server):
    async def scenario():
        body = {"input_ids": prompt_ids(5, 40), "stream": True,
                "sampling_params": GREEDY | {"max_new_tokens": 2000}}  # fmt: skip
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/generate", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        break  # hang up after the first token
        for _ in range(100):
            _, info = await get(server.url + "/server_info")
            stats = info["stats"]
            if stats["num_running_reqs"] == 0 and info["num_active_requests"] == 0:
                return stats
            await asyncio.sleep(0.1)
        raise AssertionError(f"request still running after disconnect: {stats}")

    stats = run(scenario())
    held = stats["pool_capacity_pages"] - stats["pool_free_pages"] - stats["tree_pages"]
    assert held == 0
    assert run(post(server.url + "/flush_cache", {}))[0] == 200
    _, info = run(get(server.url + "/server_info"))
    assert info["stats"]["pool_free_pages"] == info["stats"]["pool_capacity_pages"]


def test_concate_and_append_request_is_accepted_and_validated(server):
    """SGLang's frontend posts this after joining the forks' texts itself, and hangs on any
    non-200; the joined text's next call is computed exactly from the cached prefix."""
    url = server.url + "/concate_and_append_request"
    ok = {"src_rids": ["a1", "b2"], "dst_rid": "p0"}
    assert run(post(url, ok)) == (200, {"success": True})
    bad = [
        ({"dst_rid": "p0"}, "src_rids"),
        ({"src_rids": [], "dst_rid": "p0"}, "src_rids"),
        ({"src_rids": "a1", "dst_rid": "p0"}, "src_rids"),
        ({"src_rids": ["a1", 2], "dst_rid": "p0"}, "src_rids"),
        ({"src_rids": ["a1"]}, "dst_rid"),
        ({"src_rids": ["a1"], "dst_rid": 7}, "dst_rid"),
        (["a1"], "body"),
    ]
    for body, field in bad:
        status, reply = run(post(url, body))
        assert status == 400 and reply["error"]["param"] == field, (body, reply)
        assert field in reply["error"]["message"] or field == "body"


def test_max_new_tokens_may_fill_the_context_exactly(server):
    body = {"input_ids": [1] * 2040, "sampling_params": GREEDY}  # 2040 + 8 = 2048
    status, out = run(post(server.url + "/generate", body))
    assert status == 200 and len(out["output_ids"]) == 8


def test_native_temperature_has_no_upper_bound(server):
    """SGLang's sampling_params.temperature is only >= 0; OpenAI's [0, 2] bound is not native."""
    body = {"input_ids": prompt_ids(1), "sampling_params": GREEDY | {"temperature": 5.0}}
    status, out = run(post(server.url + "/generate", body))
    assert status == 200 and len(out["output_ids"]) == 8


def test_top_logprobs_num_up_to_the_bound(server):
    body = {"input_ids": prompt_ids(2), "sampling_params": GREEDY | {"max_new_tokens": 2},
            "return_logprob": True, "top_logprobs_num": 20}  # fmt: skip
    status, out = run(post(server.url + "/generate", body))
    assert status == 200
    assert [len(top) for top in out["meta_info"]["output_top_logprobs"]] == [20, 20]


def test_logit_bias_forces_and_bans_tokens(server):
    def output(params: dict) -> list[int]:
        body = {"input_ids": prompt_ids(4), "sampling_params": GREEDY | params}
        status, out = run(post(server.url + "/generate", body))
        assert status == 200, out
        return out["output_ids"]

    plain = output({})
    assert output({"temperature": 1.0, "logit_bias": {"77": 100}}) == [77] * 8
    banned = output({"logit_bias": {str(plain[0]): -100}})
    assert banned[0] != plain[0] and plain[0] not in banned
    status, out = run(post(server.url + "/generate", {"text": "a", "sampling_params": {
        "logit_bias": {"77": "high"}}}))  # fmt: skip
    assert status == 400 and out["error"]["param"] == "logit_bias"


def test_extra_key_names_the_cache_namespace_after_the_salt(server):
    ids = [(j * 29 + 11) % 3000 + 700 for j in range(64)]

    def cached(**fields) -> int:
        body = {"input_ids": ids, "sampling_params": GREEDY | {"max_new_tokens": 1}} | fields
        status, out = run(post(server.url + "/generate", body))
        assert status == 200, out
        return out["meta_info"]["cached_tokens"]

    assert cached(cache_salt="ek-salt", extra_key="-key") == 0
    assert cached(cache_salt="ek-salt-key") > 0  # SGLang's rule: the salt, then the key
    assert cached(extra_key="ek-salt-key") > 0  # either alone is the namespace
    assert cached(cache_salt="ek-salt") == 0 and cached(extra_key="-key") == 0
    body = {"text": "a", "extra_key": 5}
    status, out = run(post(server.url + "/generate", body))
    assert status == 400 and out["error"]["param"] == "extra_key"


def test_return_prompt_token_ids(server):
    """SGLang's return_prompt_token_ids: the prompt's ids beside every output, streamed too."""
    body = {"text": "Hello there", "sampling_params": GREEDY, "return_prompt_token_ids": True}
    status, out = run(post(server.url + "/generate", body))
    _, tokens = run(post(server.url + "/tokenize", {"prompt": "Hello there"}))
    assert status == 200 and out["prompt_token_ids"] == tokens["tokens"]
    events = run(stream_generate(server.url, body))
    assert all(e["prompt_token_ids"] == tokens["tokens"] for e in events if isinstance(e, dict))
    status, plain = run(post(server.url + "/generate", body | {"return_prompt_token_ids": False}))
    assert status == 200 and "prompt_token_ids" not in plain
    status, out = run(post(server.url + "/generate", body | {"return_prompt_token_ids": "yes"}))
    assert status == 400 and out["error"]["param"] == "return_prompt_token_ids"


def test_seeds_beyond_64_bits_sample_like_their_low_64_bits(server):
    """A seed past 64 bits once failed to reach the core (a 500 and a request never freed)."""

    def output(seed: int) -> list[int]:
        params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
        body = {"input_ids": prompt_ids(3), "sampling_params": params | {"sampling_seed": seed}}
        status, out = run(post(server.url + "/generate", body))
        assert status == 200, out
        return out["output_ids"]

    assert output(2**64 + 5) == output(5)
    assert output(-1) == output(2**64 - 1)
    _, info = run(get(server.url + "/server_info"))
    assert info["num_active_requests"] == 0


def test_info_endpoints(server):
    status, info = run(get(server.url + "/get_model_info"))
    assert status == 200 and info["is_generation"] is True and info["model_path"]
    status, info = run(get(server.url + "/server_info"))
    assert status == 200 and info["page_size"] == 16 and "cache_hit_rate" in info["stats"]
    assert run(get(server.url + "/nope"))[0] == 404
    assert run(get(server.url + "/ping"))[0] == run(post(server.url + "/ping", b""))[0] == 200
    status, version = run(get(server.url + "/version"))  # vLLM's
    assert status == 200 and version == {"version": radixserve.__version__}


def _metrics(server) -> dict[str, float]:
    _, text = run(get(server.url + "/metrics"))
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name + str(sorted(sample.labels.items()))] = sample.value
    return values


def test_metrics_parse_and_move(server):
    before = _metrics(server)
    run(post(server.url + "/generate", {"input_ids": prompt_ids(6), "sampling_params": GREEDY}))
    after = _metrics(server)
    for name in ("radixserve:prompt_tokens_total[]", "radixserve:generation_tokens_total[]",
                 "radixserve:e2e_request_latency_seconds_count[]",
                 "radixserve:time_to_first_token_seconds_count[]",
                 "radixserve:request_success_total[('finished_reason', 'length')]"):  # fmt: skip
        assert after[name] > before.get(name, 0), name
    assert "radixserve:kv_cache_usage_perc[]" in after
    assert "radixserve:num_requests_running[]" in after


def test_flush_cache_waits_up_to_its_timeout_for_running_requests(server):
    """SGLang's `/flush_cache?timeout=S`: refused at once while a request runs (the default
    0), flushed once it ends when asked to wait."""
    url = server.url + "/flush_cache"
    long_run = {"input_ids": prompt_ids(21), "sampling_params": GREEDY | {"max_new_tokens": 400}}

    async def scenario():
        running = asyncio.create_task(post(server.url + "/generate", long_run))
        for _ in range(200):  # until the request is admitted
            _, info = await get(server.url + "/server_info")
            if info["stats"]["num_running_reqs"] > 0:
                break
            await asyncio.sleep(0.02)
        at_once = (await post(url, {}))[0]
        waited = (await post(url + "?timeout=60", {}))[0]
        return at_once, waited, (await running)[0]

    assert run(scenario()) == (400, 200, 200)
    for bad in ("-1", "nan", "x", "301"):
        status, body = run(post(f"{url}?timeout={bad}", {}))
        assert status == 400 and body["error"]["param"] == "timeout", bad
