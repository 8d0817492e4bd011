"""Embeddings (`--is-embedding`): what a prompt's embedding is and the caller-side shapes.

An embedding request is a GenerateArgs built with `embed=True` (RequestBuilder.build): a
prefill with no output, whose last token's final-normed hidden state the core sends back
(RequestOutput.embedding, float32). Pooling is the decoder embedding models' (Qwen3-Embedding,
gte-Qwen2, e5-mistral; SGLang's and vLLM's default for them): that last token, L2-normalized;
`dimensions` keeps the leading ones first (matryoshka truncation, then the norm). The prompt's
K/V goes into the prefix cache like any other, so prompts that share a prefix (an
instruction, a document) compute it once.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from radixserve.client.request_builder import GenerateArgs
from radixserve.client.result import RequestResult
from radixserve.sampling.params import is_int

NORM_EPS = 1e-12
"""torch.nn.functional.normalize's eps: a zero vector stays zero."""


def embed_args(**fields: Any) -> GenerateArgs:
    """The request of an embedding: `fields` are GenerateArgs' (text or input_ids, rid,
    cache_salt, lora_path, priority, truncate_prompt_tokens); nothing is generated."""
    return GenerateArgs(sampling_params={"max_new_tokens": 0}, **fields)


def check_dimensions(dimensions: Any, hidden_size: int) -> int | None:
    """OpenAI's / Ollama's `dimensions`: None, or an int in [1, hidden_size]."""
    if dimensions is None:
        return None
    if not is_int(dimensions) or not 1 <= dimensions <= hidden_size:
        message = f"dimensions must be an int in [1, {hidden_size}] (the model's hidden size)"
        raise ValueError(f"{message}; got {dimensions!r}"[:200])
    return dimensions


def embedding_vector(
    result: RequestResult, dimensions: int | None = None, normalize: bool = True
) -> np.ndarray:
    """The finished request's embedding, float32: its first `dimensions` values (all when
    None), L2-normalized unless `normalize` is false."""
    if result.embedding is None:
        raise RuntimeError(f"request {result.spec.rid} ended without an embedding")
    vector = np.frombuffer(result.embedding, dtype="<f4")[:dimensions].astype(np.float32)
    if normalize:
        vector /= max(float(np.linalg.norm(vector)), NORM_EPS)
    return vector


def encode_output(result: RequestResult, normalize: bool = True) -> dict[str, Any]:
    """SGLang's /encode (and Engine.encode) output: the embedding (a classifier's scores
    unnormalized: `normalize` false) and its meta_info."""
    vector = embedding_vector(result, normalize=normalize)
    return {"embedding": vector.tolist(), "meta_info": request_meta(result)}


def request_meta(result: RequestResult) -> dict[str, Any]:
    """The meta_info of SGLang's /encode, Engine.encode and rerank outputs: the request's id,
    its prompt and cached tokens, its latency."""
    return {
        "id": result.spec.rid,
        "prompt_tokens": result.prompt_len,
        "cached_tokens": result.cached_tokens,
        "e2e_latency": result.e2e_latency(),
    }


def openai_embedding(vector: np.ndarray, index: int, encoding_format: str) -> dict[str, Any]:
    """One item of OpenAI's embeddings list: floats, or base64 of the little-endian float32
    bytes (what the openai library asks for by default and decodes with numpy)."""
    if encoding_format == "base64":
        data: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    else:
        data = vector.tolist()
    return {"object": "embedding", "index": index, "embedding": data}
