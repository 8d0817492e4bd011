"""The HF transformers baseline server (radixserve_bench.hf_server) in a subprocess: greedy
output equal to transformers' own `generate`, alone and in left-padded static batches,
streaming, exact lengths, errors, and the bench client against it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest
import torch

from conftest import ServerProcess, hf_model, prompt_ids
from radixserve_bench.backends import NativeBackend
from radixserve_bench.client import LoadShape, run_online
from radixserve_bench.hf_batcher import HFRequest, RowsDone, RowStreamer, left_pad
from radixserve_bench.workloads import default_tokenizer, make_workload, parse_overrides

MAX_BATCH = 4


class HFServerProcess(ServerProcess):
    def command(self, model: str) -> list[str]:
        return [sys.executable, "-m", "radixserve_bench.hf_server", "--model", model]


@pytest.fixture(scope="module")
def hf_server(tiny_chat_model):
    # a long batch wait so that requests sent together reliably share one batch
    flags = ["--max-batch-size", str(MAX_BATCH), "--batch-wait-ms", "300", "--device", "cpu"]
    proc = HFServerProcess(tiny_chat_model, *flags)
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    """transformers' own greedy `generate` on a batch of one, no stop tokens."""
    model = hf_model(tiny_chat_model)

    @torch.inference_mode()
    def generate(prompt: list[int], num_tokens: int) -> list[int]:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        return out[0, len(prompt) :].tolist()

    return generate


def greedy(max_new_tokens: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True} | extra


async def post(url: str, body) -> tuple[int, dict | str]:
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, str) else json.dumps(body)
        async with session.post(url, data=data) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text.startswith("{") else text)


async def get(url: str) -> tuple[int, dict | str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text.startswith("{") else text)


async def stream(url: str, body: dict) -> list:
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=body | {"stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    payload = line[len(b"data: ") :].strip()
                    events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def generate_all(url: str, bodies: list[dict]) -> list[dict]:
    async def send_all():
        return await asyncio.gather(*(post(url + "/generate", b) for b in bodies))

    answers = asyncio.run(send_all())
    assert all(status == 200 for status, _ in answers), answers
    return [answer for _, answer in answers]


def num_batches(url: str) -> int:
    return asyncio.run(get(url + "/server_info"))[1]["batches"]["num_batches"]


# ---- output -------------------------------------------------------------------------------

PROMPT_LENS, MAX_NEW = (5, 17, 40, 64), (8, 3, 12, 5)


def test_greedy_matches_transformers_alone_and_in_a_padded_batch(hf_server, reference):
    prompts = [prompt_ids(i, n) for i, n in enumerate(PROMPT_LENS)]
    expected = [reference(p, max(MAX_NEW)) for p in prompts]
    bodies = [{"input_ids": p, "sampling_params": greedy(n)} for p, n in zip(prompts, MAX_NEW)]
    alone = [generate_all(hf_server.url, [b])[0] for b in bodies]
    before = num_batches(hf_server.url)
    batched = generate_all(hf_server.url, bodies)
    assert num_batches(hf_server.url) == before + 1  # one generate, prompts left-padded to 64
    for answers in (alone, batched):
        for answer, want, prompt, n in zip(answers, expected, prompts, MAX_NEW):
            assert answer["output_ids"] == want[:n]  # each request gets exactly its own count
            meta = answer["meta_info"]
            assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), n)
            assert meta["finish_reason"] == {"type": "length", "length": n}
            assert meta["cached_tokens"] == 0


def test_text_prompt_is_tokenized_like_radixserve(hf_server, reference):
    tokenizer = default_tokenizer()
    [answer] = generate_all(hf_server.url, [{"text": "Hello there", "sampling_params": greedy(4)}])
    prompt = tokenizer.encode("Hello there")
    assert answer["meta_info"]["prompt_tokens"] == len(prompt)
    assert answer["output_ids"] == reference(prompt, 4)
    assert answer["text"] == tokenizer.decode(answer["output_ids"], skip_special_tokens=True)


def test_stream_delivers_each_token_as_it_is_made(hf_server):
    body = {"input_ids": prompt_ids(7), "sampling_params": greedy(6)}
    events = asyncio.run(stream(hf_server.url, body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
    for before, after in zip(chunks, chunks[1:]):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    [whole] = generate_all(hf_server.url, [body])
    assert chunks[-1]["output_ids"] == whole["output_ids"] and len(whole["output_ids"]) == 6
    assert chunks[-1]["text"] == whole["text"]


def test_more_requests_than_a_batch_all_complete(hf_server):
    before = num_batches(hf_server.url)
    bodies = [{"input_ids": prompt_ids(i, 8 + i), "sampling_params": greedy(3)} for i in range(10)]
    answers = generate_all(hf_server.url, bodies)
    assert [len(a["output_ids"]) for a in answers] == [3] * 10
    assert num_batches(hf_server.url) - before >= 10 // MAX_BATCH + 1


def test_a_client_leaving_mid_stream_leaves_the_server_serving(hf_server):
    async def leave_after_first_chunk():
        body = {"input_ids": prompt_ids(3), "sampling_params": greedy(100), "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(hf_server.url + "/generate", json=body) as resp:
                await resp.content.readline()

    asyncio.run(leave_after_first_chunk())
    [answer] = generate_all(hf_server.url, [{"input_ids": [1, 2], "sampling_params": greedy(2)}])
    assert len(answer["output_ids"]) == 2


# ---- errors and info ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ("not json", "body"),
        ([1, 2], "body"),
        ({"sampling_params": greedy(2)}, "input_ids"),
        ({"input_ids": [], "sampling_params": greedy(2)}, "input_ids"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": greedy(2)}, "input_ids"),
        ({"input_ids": [1, 49152], "sampling_params": greedy(2)}, "input_ids"),
        ({"input_ids": [1], "text": "hi", "sampling_params": greedy(2)}, "input_ids"),
        ({"text": ["a", "b"], "sampling_params": greedy(2)}, "text"),
        ({"text": "hi", "sampling_params": greedy(2), "return_logprob": True}, "return_logprob"),
        ({"text": "hi", "sampling_params": greedy(2), "stream": "yes"}, "stream"),
        ({"text": "hi", "sampling_params": [1]}, "sampling_params"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_naming_the_field(hf_server, body, param):
    assert_refused(hf_server.url, body, param)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"max_new_tokens": 2}, "temperature"),  # SGLang's default temperature is 1.0
        (greedy(2, temperature=0.7), "temperature"),
        (greedy(0), "max_new_tokens"),
        (greedy(2048 - 5), "max_new_tokens"),  # beyond the context length with the prompt
        (greedy(2, stop=["x"]), "stop"),
        (greedy(2, ignore_eos="no"), "ignore_eos"),
    ],
)
def test_unsupported_sampling_is_refused_naming_the_field(hf_server, params, field):
    body = {"input_ids": prompt_ids(0, 10), "sampling_params": params}
    assert_refused(hf_server.url, body, "sampling_params." + field)


def assert_refused(url: str, body, param: str) -> None:
    status, answer = asyncio.run(post(url + "/generate", body))
    assert status == 400
    assert answer["error"]["param"] == param and answer["error"]["code"] == 400


def test_health_server_info_and_flush_cache(hf_server):
    assert asyncio.run(get(hf_server.url + "/health"))[0] == 200
    status, info = asyncio.run(get(hf_server.url + "/server_info"))
    assert status == 200 and info["system"] == "hf-transformers"
    assert info["max_batch_size"] == MAX_BATCH and info["model"]
    assert asyncio.run(post(hf_server.url + "/flush_cache", {}))[0] == 200


def test_bench_client_runs_against_it(hf_server):
    args = "num_groups=2,prompts_per_group=3,system_len=64,question_len=8,output_len=4"
    workload = make_workload("shared-prefix", default_tokenizer(), 0, overrides=parse_overrides(
        args))  # fmt: skip
    backend = NativeBackend(hf_server.url, name="hf-transformers")
    run = asyncio.run(run_online(workload, backend, LoadShape(num_warmup=0), progress=False))
    m = run.metrics
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (6, 0, 6 * 4)
    assert m["cache_hit_rate"] == 0 and m["mean_ttft_ms"] > 0
    assert run.info["server"]["system"] == "hf-transformers"


def test_sigterm_mid_batch_aborts_it_and_exits_cleanly(tiny_chat_model):
    proc = HFServerProcess(tiny_chat_model, "--device", "cpu")
    body = {"input_ids": prompt_ids(1), "sampling_params": greedy(1500)}

    async def stream_then_stop():
        task = asyncio.create_task(stream(proc.url, body))
        await asyncio.sleep(1.0)
        started = time.perf_counter()
        code = await asyncio.to_thread(proc.stop)
        return code, time.perf_counter() - started, await task

    code, took, events = asyncio.run(stream_then_stop())
    assert code == 0 and took < 15
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "abort"


# ---- the batch worker's parts, without a server --------------------------------------------


def test_rows_stop_at_their_own_length_or_at_eos():
    async def run_steps():
        loop = asyncio.get_running_loop()
        reqs = [HFRequest([5], 3, True, loop), HFRequest([5, 6], 3, False, loop)]
        ids, mask = left_pad([r.input_ids for r in reqs], pad_id=0)
        assert ids.tolist() == [[0, 5], [5, 6]] and mask.tolist() == [[0, 1], [1, 1]]
        streamer, eos = RowStreamer(reqs, frozenset({2})), frozenset({2})
        done = RowsDone(reqs, ids.shape[1], eos, asyncio.Event())  # any object with is_set
        streamer.put(ids)  # the prompt, as generate's first put
        for step in ([2, 7], [2, 2], [9, 9]):
            ids = torch.cat([ids, torch.tensor(step)[:, None]], dim=1)
            flags = done(ids, None).tolist()
            streamer.put(torch.tensor(step))
        await asyncio.sleep(0)
        return flags, [[r.steps.get_nowait() for _ in range(r.steps.qsize())] for r in reqs]

    flags, (ignoring, stopping) = asyncio.run(run_steps())
    assert flags == [True, True]
    assert [s.token for s in ignoring] == [2, 2, 9]  # ignore_eos: exactly max_new_tokens
    assert ignoring[-1].finish_reason == {"type": "length", "length": 3}
    assert [s.token for s in stopping] == [7, 2]  # stops at EOS, later tokens dropped
    assert stopping[-1].finish_reason == {"type": "stop", "matched": 2}


# ---- continuous batching (transformers' init_continuous_batching) --------------------------

CB_PAGE = 16


@pytest.fixture(scope="module")
def hf_cb_server(tiny_chat_model):
    flags = ["--batching", "continuous", "--max-batch-size", str(MAX_BATCH), "--device", "cpu",
             "--cb-page-size", str(CB_PAGE), "--cb-num-blocks", "64", "--cb-max-batch-tokens",
             "256"]  # fmt: skip
    proc = HFServerProcess(tiny_chat_model, *flags)
    yield proc
    assert proc.stop() == 0


def test_continuous_batching_matches_transformers_and_reports_its_prefix_hits(
    hf_cb_server, reference
):
    shared = prompt_ids(9, 3 * CB_PAGE)
    prompts = [shared + prompt_ids(i, 5) for i in range(3)]
    expected = [reference(p, 4) for p in prompts]
    first = generate_all(
        hf_cb_server.url, [{"input_ids": prompts[0], "sampling_params": greedy(4)}]
    )
    later = generate_all(hf_cb_server.url, [{"input_ids": p, "sampling_params": greedy(4)}
                                            for p in prompts[1:]])  # fmt: skip
    answers = first + later
    assert [a["output_ids"] for a in answers] == expected
    assert answers[0]["meta_info"]["cached_tokens"] == 0
    # the later prompts find the first one's three whole shared blocks in its paged cache
    assert [a["meta_info"]["cached_tokens"] for a in later] == [3 * CB_PAGE] * 2
    assert all(a["meta_info"]["completion_tokens"] == 4 for a in answers)


def test_continuous_batching_streams_and_refuses_an_unknown_mode(hf_cb_server, tiny_chat_model):
    events = asyncio.run(
        stream(hf_cb_server.url, {"input_ids": prompt_ids(4), "sampling_params": greedy(5)})
    )
    assert events[-1] == "[DONE]" and len(events[-2]["output_ids"]) == 5
    # one event per token as it is made, however late the server's loop reads them
    assert [len(e["output_ids"]) for e in events[:-1]] == [1, 2, 3, 4, 5]
    proc = subprocess.run([sys.executable, "-m", "radixserve_bench.hf_server", "--model",
                           tiny_chat_model, "--batching", "dynamic"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "--batching must be static or continuous" in proc.stderr
