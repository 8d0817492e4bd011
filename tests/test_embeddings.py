"""--is-embedding: each prompt's last final-normed hidden state, L2-normalized, through
Engine.encode, SGLang's /encode, OpenAI's /v1/embeddings (the openai library), Ollama's
/api/embed and /api/embeddings (the ollama library), checked against transformers."""

from __future__ import annotations

import asyncio
import base64

import aiohttp
import numpy as np
import openai
import pytest
import torch
from fuzz_common import FUZZ_SETTINGS, check
from fuzz_embeddings import EMBEDDING_CASES, embedding_problems
from hypothesis import given

from conftest import ServerProcess, hf_model, make_engine, prompt_ids
from radixserve.client.embedding import check_dimensions

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def hf(tiny_chat_model):
    return hf_model(tiny_chat_model)


def hf_hidden(hf, ids: list[int]) -> np.ndarray:
    """transformers' final-normed hidden state of the prompt's last token (unnormalized)."""
    with torch.inference_mode():
        return hf.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()


def unit(vector) -> np.ndarray:
    vector = np.asarray(vector, dtype=np.float64)
    return vector / np.linalg.norm(vector)


@pytest.fixture(scope="module")
def embed_server(tiny_chat_model):
    proc = ServerProcess(tiny_chat_model, "--is-embedding", "--max-total-tokens", "4096",
                         "--page-size", "16", "--served-model-name", "emb")  # fmt: skip
    yield proc
    assert proc.stop() == 0


def post(url: str, path: str, body, headers=None) -> tuple[int, dict]:
    return asyncio.run(_request("POST", url + path, body, headers))


def get(url: str, path: str) -> tuple[int, dict | str]:
    return asyncio.run(_request("GET", url + path, None, None))


async def _request(method: str, url: str, body, headers) -> tuple[int, dict | str]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, json=body, headers=headers) as r:
            is_json = r.content_type == "application/json"
            return r.status, await (r.json() if is_json else r.text())


def test_engine_encode_matches_transformers_cold_warm_and_chunked(tiny_chat_model, hf):
    shared = prompt_ids(3, 40)
    prompts = [shared + prompt_ids(i, 9) for i in range(3)] + [prompt_ids(7, 5)]
    engine = make_engine(tiny_chat_model, is_embedding=True, chunked_prefill_size=16,
                         max_total_tokens=512)  # fmt: skip
    try:
        first = engine.encode(input_ids=prompts[0])
        later = engine.encode(input_ids=prompts[1:])
        again = engine.encode(input_ids=prompts[0])
        for ids, out in zip(prompts, [first, *later]):
            assert np.abs(np.array(out["embedding"]) - unit(hf_hidden(hf, ids))).max() < 1e-5
            assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert first["meta_info"]["cached_tokens"] == 0
        # the later prompts find the shared prefix's whole pages; the same prompt all but its last
        assert [o["meta_info"]["cached_tokens"] for o in later] == [32, 32, 0]
        assert again["meta_info"]["cached_tokens"] == 48
        assert np.abs(np.array(again["embedding"]) - np.array(first["embedding"])).max() < 1e-5
        assert isinstance(engine.encode("a sentence to embed"), dict)
        with pytest.raises(ValueError, match="does not generate"):
            engine.generate("hello", {"max_new_tokens": 2})
        with pytest.raises(ValueError, match="prompt is empty"):
            engine.encode(input_ids=[])
        with pytest.raises(ValueError, match="embed instead"):  # no head, no label tokens
            engine.score(query="q", items=["a"], label_token_ids=[1])
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_generating_engine_refuses_embeddings_and_bad_flags_fail_at_start(
    engine, tiny_chat_model
):
    with pytest.raises(ValueError, match="--is-embedding"):
        engine.encode("hello")
    with pytest.raises(ValueError, match="--speculative-algorithm"):
        make_engine(tiny_chat_model, is_embedding=True, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="dimensions must be an int in \\[1, 64\\]"):
        check_dimensions(65, 64)


def test_encode_and_openai_embeddings_agree_with_transformers(embed_server, hf):
    ids = [prompt_ids(1, 20), prompt_ids(2, 33)]
    status, encoded = post(embed_server.url, "/encode", {"input_ids": ids})
    assert status == 200 and len(encoded) == 2
    for prompt, out in zip(ids, encoded):
        assert np.abs(np.array(out["embedding"]) - unit(hf_hidden(hf, prompt))).max() < 1e-5
    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="none")
    served = client.models.list().data[0].id
    packed = client.embeddings.create(model=served, input=ids)  # the library asks for base64
    floats = client.embeddings.create(model=served, input=ids, encoding_format="float")
    assert packed.model == served and packed.usage.prompt_tokens == 53
    for a, b, out in zip(packed.data, floats.data, encoded):
        assert np.abs(np.array(a.embedding) - np.array(out["embedding"])).max() < 1e-6
        assert a.embedding == b.embedding
    short = client.embeddings.create(model=served, input=ids[0], dimensions=8,
                                     encoding_format="float")  # fmt: skip
    expected = unit(hf_hidden(hf, ids[0])[:8])
    assert np.abs(np.array(short.data[0].embedding) - expected).max() < 1e-5
    # text goes through the server's tokenizer, the same for both routes
    text = "Agents embed the same instructions again and again."
    status, by_text = post(embed_server.url, "/encode", {"text": text})
    raw = post(embed_server.url, "/v1/embeddings", {"input": [text], "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(raw[1]["data"][0]["embedding"]), "<f4")
    assert np.abs(vector - np.array(by_text["embedding"])).max() < 1e-6
    raw = post(embed_server.url, "/v1/embeddings", {"input": text, "normalize": False,
                                                    "encoding_format": "float"})  # fmt: skip
    assert np.linalg.norm(raw[1]["data"][0]["embedding"]) > 1.5  # a raw hidden state


def test_ollama_embed_and_embeddings(embed_server, hf):
    import ollama

    client = ollama.Client(host=embed_server.url)
    served = client.list().models[0].model
    texts = ["first input", "the second input is longer"]
    answer = client.embed(model=served, input=texts)
    status, encoded = post(embed_server.url, "/encode", {"text": texts})
    assert answer.prompt_eval_count == sum(o["meta_info"]["prompt_tokens"] for o in encoded)
    for got, out in zip(answer.embeddings, encoded):
        assert np.abs(np.array(got) - np.array(out["embedding"])).max() < 1e-6
    shown = client.show(served)
    assert shown.capabilities == ["embedding"]
    assert shown.modelinfo["llama.embedding_length"] == 64
    legacy = client.embeddings(model=served, prompt=texts[0]).embedding  # not normalized
    assert np.linalg.norm(legacy) > 1.5
    assert np.abs(unit(legacy) - np.array(encoded[0]["embedding"])).max() < 1e-5
    status, answer = post(embed_server.url, "/api/embed", {"model": served, "input": [3]})
    assert status == 400 and answer == {"error": "input must be a string or a list of strings"}
    with pytest.raises(ollama.ResponseError) as missing:
        client.embed(model="nope", input="x")
    assert missing.value.status_code == 404


def test_tenants_share_prefixes_only_within_their_salt(embed_server):
    body = {"input_ids": prompt_ids(5, 40)}
    first = post(embed_server.url, "/encode", body | {"cache_salt": "tenant-a"})[1]
    same = post(embed_server.url, "/encode", body | {"cache_salt": "tenant-a"})[1]
    other = post(embed_server.url, "/encode", body, {"X-Cache-Salt": "tenant-b"})[1]
    assert first["meta_info"]["cached_tokens"] == 0 and same["meta_info"]["cached_tokens"] == 32
    assert other["meta_info"]["cached_tokens"] == 0
    assert first["embedding"] == other["embedding"]


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/embeddings", {"input": []}, 400, "input"),
        ("/v1/embeddings", {"input": ""}, 400, "input"),
        ("/v1/embeddings", {"input": ["a", [1, 2]]}, 400, "input"),
        ("/v1/embeddings", {"input": [[-1]]}, 400, "input"),
        ("/v1/embeddings", {"input": "a", "dimensions": 65}, 400, "dimensions"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "model": "other"}, 404, "model"),
        ("/v1/embeddings", {"input": "a", "top_k": 3}, 400, "top_k"),
        ("/v1/embeddings", {"input": "a", "normalize": "yes"}, 400, "normalize"),
        ("/v1/embeddings", {"input": ["a"] * 2049}, 400, "input"),
        ("/encode", {"text": "a", "sampling_params": {}}, 400, "sampling_params"),
        ("/encode", {}, 400, "text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, None),
        ("/generate", {"text": "hi"}, 400, None),
        ("/classify", {"input": "hi"}, 400, None),  # not a classifier
        ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [1]}, 400, None),
    ],
)
def test_bad_input_is_a_400_naming_the_field(embed_server, path, body, status, param):
    got, answer = post(embed_server.url, path, body)
    assert got == status and answer["error"]["param"] == param, answer


def test_a_generating_server_refuses_embeddings_naming_the_flag(server, embed_server):
    status, answer = post(server.url, "/v1/embeddings", {"input": "hello"})
    assert status == 400 and "--is-embedding" in answer["error"]["message"]
    served = get(server.url, "/api/tags")[1]["models"][0]["name"]
    status, answer = post(server.url, "/api/embed", {"model": served, "input": "hello"})
    assert status == 400 and "--is-embedding" in answer["error"]  # Ollama's error shape
    for empty in ({"model": served, "input": []}, {"model": served, "prompt": ""}):
        path = "/api/embed" if "input" in empty else "/api/embeddings"
        assert post(server.url, path, empty)[0] == 400  # nothing to embed: still not here
    assert get(server.url, "/model_info")[1]["is_generation"] is True
    assert get(embed_server.url, "/model_info")[1]["is_generation"] is False
    assert get(embed_server.url, "/health_generate")[0] == 200


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_headless_checkpoints_load_as_embedding_models(arch, tmp_path):
    """AutoModel's checkpoints (Qwen3Model, MistralModel: no LM head, no `model.` prefix), as
    Qwen3-Embedding and e5-mistral ship, embed as transformers does; they cannot generate."""
    from transformers import AutoModel

    from conftest import TINY_CONFIGS, VOCAB
    from radixserve.config.model import UnsupportedModelError

    torch.manual_seed(3)
    config = TINY_CONFIGS[arch]()
    config.vocab_size = VOCAB  # the default model's tokenizer stands in
    base = AutoModel.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(tmp_path)
    ids = [prompt_ids(4, 21), prompt_ids(6, 9)]
    engine = make_engine(tmp_path, is_embedding=True)
    try:
        for prompt, out in zip(ids, engine.encode(input_ids=ids)):
            with torch.inference_mode():
                expected = base(torch.tensor([prompt])).last_hidden_state[0, -1].numpy()
            assert np.abs(np.array(out["embedding"]) - unit(expected)).max() < 1e-5
    finally:
        engine.shutdown()
    with pytest.raises(UnsupportedModelError, match="no LM head.*--is-embedding"):
        make_engine(tmp_path)


def test_sentence_transformers_pooling_must_be_the_last_token(tiny_chat_model, tmp_path):
    import json
    import shutil

    from radixserve.config.model import UnsupportedModelError

    folder = tmp_path / "st"
    shutil.copytree(tiny_chat_model, folder)
    (folder / "1_Pooling").mkdir()
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode_mean_tokens": True,
                                   "pooling_mode_lasttoken": False}))  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="pools by mean_tokens"):
        make_engine(folder, is_embedding=True)
    pooling.write_text(json.dumps({"pooling_mode_mean_tokens": False,
                                   "pooling_mode_lasttoken": True}))  # fmt: skip
    engine = make_engine(folder, is_embedding=True)
    try:
        assert len(engine.encode(input_ids=prompt_ids(1, 5))["embedding"]) == 64
    finally:
        engine.shutdown()


def test_lora_adapters_embed_as_peft_does_and_keep_their_kv_apart(tmp_path):
    """An embedding request names its adapter (lora_path; on the APIs, model): PEFT's hidden
    state, and an adapter's prompt never hits the base's cached K/V."""
    import peft
    from lora_data import build_lora_models

    base_folder, folders = build_lora_models(tmp_path)
    paths = [f"{name}={folder}" for name, folder in folders.items()]
    prompt = prompt_ids(8, 40)
    engine = make_engine(str(base_folder), is_embedding=True, lora_paths=paths,
                         max_loras_per_batch=3)  # fmt: skip
    try:
        base = engine.encode(input_ids=prompt)
        tuned = engine.encode(input_ids=[prompt, prompt], lora_path=["a1", "a2"])
    finally:
        engine.shutdown()
    assert [o["meta_info"]["cached_tokens"] for o in tuned] == [0, 0]  # not the base's K/V
    expected = {None: hf_hidden(hf_model(base_folder), prompt)}
    for name, folder in folders.items():
        model = peft.PeftModel.from_pretrained(hf_model(base_folder), folder).eval()
        expected[name] = hf_hidden(model.base_model.model, prompt)
    for name, out in zip([None, "a1", "a2"], [base, *tuned]):
        assert np.abs(np.array(out["embedding"]) - unit(expected[name])).max() < 1e-5
    assert np.abs(unit(expected["a1"]) - unit(expected[None])).max() > 1e-2  # it changes them


def test_an_embedding_model_reranks_by_cosine(embed_server):
    query, docs = "where do pandas live", ["bamboo forests in China", "the sea", "pandas"]
    _, embedded = post(embed_server.url, "/v1/embeddings", {"input": [query, *docs]})
    vectors = [np.asarray(d["embedding"]) for d in embedded["data"]]
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    status, answer = post(embed_server.url, "/rerank", {"query": query, "documents": docs})
    assert (
        status == 200 and [r["index"] for r in answer["results"]] == np.argsort(want)[::-1].tolist()
    )
    assert all(abs(r["relevance_score"] - want[r["index"]]) < 1e-5 for r in answer["results"])


def test_a_batch_of_embedding_lines(embed_server):
    """OpenAI's Batch API with endpoint /v1/embeddings: each line's body as /v1/embeddings
    answers it (in the owner's namespace, or the line's own cache_salt), a bad line in the
    error file."""
    from test_server_batches import line, records, upload, wait_ended

    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="none",
                           default_headers={"X-Cache-Salt": "owner"})  # fmt: skip
    bodies = [{"input": f"line {i}", "encoding_format": "float"} for i in range(3)]
    bodies[2]["cache_salt"] = "its-own"  # not the owner's: the line's namespace wins
    lines = [line(f"e{i}", body, "/v1/embeddings") for i, body in enumerate(bodies)]
    lines.append(line("bad", {"input": []}, "/v1/embeddings"))
    batch = client.batches.create(input_file_id=upload(client, lines).id,
                                  endpoint="/v1/embeddings", completion_window="24h")  # fmt: skip
    batch = wait_ended(client, batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    outputs = records(client, batch.output_file_id)
    for i, body in enumerate(bodies):
        direct = post(embed_server.url, "/v1/embeddings", body)[1]
        answer = outputs[f"e{i}"]["response"]
        assert answer["status_code"] == 200 and answer["body"]["usage"] == direct["usage"]
        got = np.array(answer["body"]["data"][0]["embedding"])  # batched alike or not: rounding
        assert np.abs(got - np.array(direct["data"][0]["embedding"])).max() < 1e-5
    error = records(client, batch.error_file_id)["bad"]["response"]
    assert error["status_code"] == 400 and error["body"]["error"]["param"] == "input"


def test_tensor_parallel_embeddings_equal_one_rank(tiny_chat_model):
    """Rank 0 returns the (replicated) final-normed hidden rows; tp 2 == tp 1."""
    ids = [prompt_ids(1, 30), prompt_ids(2, 50)]
    outs = []
    for tp in (1, 2):
        engine = make_engine(tiny_chat_model, is_embedding=True, tp_size=tp)
        try:
            outs.append([np.array(o["embedding"]) for o in engine.encode(input_ids=ids)])
        finally:
            engine.shutdown()
    for one, two in zip(*outs):
        assert np.abs(one - two).max() < 1e-5


@FUZZ_SETTINGS
@given(case=EMBEDDING_CASES)
def test_fuzz_embedding_routes(embed_server, case):
    path, body = case
    check(embed_server.url + path, body, embedding_problems(path))


def test_zz_after_the_fuzz_nothing_leaks(embed_server):
    """Runs last in this file (pytest keeps file order): every page free after a flush."""
    assert post(embed_server.url, "/flush_cache", {})[0] == 200
    integrity = get(embed_server.url, "/check_integrity")[1]
    assert integrity["pool_free_pages"] == integrity["pool_capacity_pages"], integrity
