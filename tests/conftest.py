"""Shared fixtures: tiny seeded random models of each architecture, saved as HF folders."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `make test` runs two xdist workers on CI's two cores: each worker, and every server, fleet
# and child pytest it starts, runs one OpenMP thread. Two threads each oversubscribed the
# cores, and each parallel region then waited on a descheduled thread (the suite took
# 1100-1313 s so on a 2-core EPYC, 813-947 s with one thread each). Thread splits are tested
# where a test sets its own count (kernel_checks.py).
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from radixserve.config import CacheConfig, LoadConfig  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.runner import ModelRunner  # noqa: E402
from radixserve_bench.systems import free_port  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.1,
    eos_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
GEMMA3_TINY = dict(
    num_hidden_layers=3,
    head_dim=16,
    sliding_window=12,
    sliding_window_pattern=3,
    query_pre_attn_scalar=24,
    rope_local_base_freq=100.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    final_logit_softcapping=30.0,
)
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=24),
    "qwen2": lambda: Qwen2Config(**TINY),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True),
    # hybrid: layer 1 slides within 12 tokens, layer 0 attends globally (max_window_layers)
    "qwen2_swa": lambda: Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=12, max_window_layers=1
    ),
    # layers 0-1 slide (local RoPE base), layer 2 is global (linear-scaled RoPE)
    "gemma3": lambda: Gemma3TextConfig(**(TINY | GEMMA3_TINY)),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a `slow` test first, in their order, then the rest: under `make test`'s two
    workers (xdist, whole files per worker) the long files start early instead of finishing
    last on one worker while the other idles. The order is the same in every worker."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file's own order


def save_tiny_model(
    arch: str, folder: Path, seed: int = 0, vocab_size: int | None = None, **save_kwargs
) -> Path:
    """TINY_CONFIGS[arch] with random weights (seeded), optionally another vocabulary size."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[arch]()
    if vocab_size is not None:
        config.vocab_size = vocab_size
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder, **save_kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: save_tiny_model(arch, root / arch) for arch in TINY_CONFIGS}


def make_runner(
    model: Path | str | None,
    page_size: int = 16,
    max_total_tokens: int = 4096,
    load_format: str = "auto",
    quantization: str = "auto",
):
    return ModelRunner.create(
        LoadConfig(
            model=None if model is None else str(model),
            load_format=load_format,
            device="cpu",
            quantization=quantization,
        ),
        CacheConfig(page_size=page_size, max_total_tokens=max_total_tokens),
    )


def hf_model(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Reference greedy decoding: full recompute each step, no cache, no stop tokens."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# ---- engine tests: a tiny model with SmolLM2's vocabulary ----

VOCAB = 49152
SYSTEM = [(i * 7919 + 13) % 5000 + 100 for i in range(200)]


@pytest.fixture(scope="session")
def cpu_ops():
    """The C++ CPU attention kernels, built or loaded. A test using them skips where there
    is no compiler, and fails where there is one and the build breaks (a skip would hide a
    broken kernel)."""
    from radixserve.native.extension import CpuExtensionUnavailable, load_cpu_ops

    try:
        return load_cpu_ops()
    except CpuExtensionUnavailable as exc:
        reason = str(exc)
        if "no C++ compiler" in reason:
            pytest.skip(reason.splitlines()[0])
        pytest.fail(f"the C++ kernels do not build with the compiler here: {reason[-3000:]}")


@pytest.fixture(scope="session")
def bf16_sdpa() -> None:
    """Skips a test whose bf16 reference is torch's SDPA where that fails: torch 2.13 on an
    AMX CPU under ATEN_CPU_CAPABILITY=avx2 raises "pack_vnni2 is only supported when avx512
    is supported" (tests/test_cpu_isa_paths.py runs the kernel tests so)."""
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as exc:
        pytest.skip(f"torch's bf16 SDPA fails at this CPU capability: {exc}")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """A tiny Llama with SmolLM2's vocabulary, so the Engine can borrow its tokenizer."""
    torch.manual_seed(1)
    config = LlamaConfig(**(TINY | {"vocab_size": VOCAB, "max_position_embeddings": 2048}))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny_chat")
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def periodic_model(tmp_path_factory) -> str:
    """A tiny Llama whose greedy output cycles (speculative_common.py's CYCLE)."""
    from speculative_common import save_periodic_model

    return save_periodic_model(tmp_path_factory.mktemp("periodic"))


def make_engine(model, **kwargs):
    from radixserve import Engine

    return Engine(model, **({"max_total_tokens": 8192, "page_size": 16} | kwargs))


def make_core(model, **kwargs):
    """An EngineCore with no client: for tests that drive `core.scheduler.step()` themselves
    (an Engine's core thread would step it too)."""
    from radixserve.config import split_engine_kwargs
    from radixserve.engine.core import EngineCore

    kwargs = {"max_total_tokens": 8192, "page_size": 16} | kwargs
    return EngineCore.build(*split_engine_kwargs(model, kwargs))


def greedy(max_new_tokens=16, **extra):
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True} | extra


def prompt_ids(i: int, length: int = 30) -> list[int]:
    return [(i * 131 + j * 17) % 4000 + 200 for j in range(length)]


def greedy_generate(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Runner-level reference driver, independent of the scheduler: prefills all prompts in
    one batch, then decodes them together; returns new token ids and frees every page."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    pool = runner.pool
    tables: list[list[int]] = [[] for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    lens = [0] * len(prompts)
    active = list(range(len(prompts)))
    new_tokens = {i: list(p) for i, p in enumerate(prompts)}
    try:
        while active:
            for i in active:
                tables[i] = pool.extend_page_table(tables[i], lens[i] + len(new_tokens[i]))
            batch = ForwardBatch.build(
                [new_tokens[i] for i in active],
                [lens[i] for i in active],
                [tables[i] for i in active],
                pool.page_size,
                runner.device,
            )
            next_ids = runner.forward(batch).last.argmax(dim=-1).tolist()
            still_active = []
            for i, token in zip(active, next_ids):
                lens[i] += len(new_tokens[i])
                outputs[i].append(token)
                new_tokens[i] = [token]
                if len(outputs[i]) < max_new_tokens and token not in stop_token_ids:
                    still_active.append(i)
            active = still_active
    finally:
        for table in tables:
            pool.allocator.free(table)
    return outputs


# ---- server tests: `radixserve serve` in a subprocess on a free loopback port ----


class ServerProcess:
    """A `radixserve serve` subprocess; `url` once ready, `stop()` sends SIGTERM. A subclass
    may serve another program by overriding `command`. With `wait=False` it returns at once;
    `wait_ready()` then waits, so that several servers start side by side. `env`: variables
    added to this process's environment for it."""

    def __init__(
        self, model: str, *flags: str, wait: bool = True, env: dict[str, str] | None = None
    ):
        import subprocess

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*self.command(model), "--port", str(self.port), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ | (env or {}),
        )
        self.log: list[str] = []
        self.ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> ServerProcess:
        """Reads the server's output until it says it is ready (raises if it exits first)."""
        if self.ready:
            return self
        for line in self.proc.stdout:
            self.log.append(line)
            if "ready at" in line:
                break
        else:
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        self.ready = True
        threading.Thread(target=self._drain_output, daemon=True).start()
        return self

    def command(self, model: str) -> list[str]:
        """The program line before `--port PORT` and the flags."""
        serve = [sys.executable, "-m", "radixserve.cli", "serve", model]
        return [*serve, "--max-total-tokens", "16384"]

    def _drain_output(self) -> None:
        """Keeps reading the server's output so a chatty server never blocks on a full pipe."""
        for line in self.proc.stdout:
            self.log.append(line)

    def stop(self, timeout: float = 60) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def stop_running(servers: Sequence[ServerProcess]) -> None:
    """Stops every server that still runs: the teardown of servers launched ahead of their
    tests (a test that stops its own checks the exit code itself)."""
    for proc in servers:
        if proc.proc.poll() is None:
            proc.stop()


@pytest.fixture(scope="session")
def server(tiny_chat_model):
    """A plain `radixserve serve`: it forks its core (client/core_start.py); the keyed server
    (a key in its environment) spawns it."""
    proc = ServerProcess(tiny_chat_model, "--served-model-name", "tiny")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def openai_client(server):
    """The `openai` client of the plain server (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


API_KEY = "sekret"
ADMIN_API_KEY = "admin-sekret-4d1f"


@pytest.fixture(scope="session")
def keyed_server(tiny_chat_model, tmp_path_factory):
    """A server with the user key API_KEY (read from --api-key-file) and the admin key
    ADMIN_API_KEY (from $RADIXSERVE_ADMIN_API_KEY): neither on its command line. Shared by the
    tests of what the keys guard; they send nothing that stays running, so each sees the
    server idle."""
    key_file = tmp_path_factory.mktemp("keys") / "api-key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    env = {"RADIXSERVE_ADMIN_API_KEY": ADMIN_API_KEY}  # spawns: a key in the env
    proc = ServerProcess(tiny_chat_model, "--api-key-file", str(key_file), env=env)
    yield proc
    assert proc.stop() == 0


# ---- frontend language tests: each test runs on both backends ----


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    """One engine per test module (a module may override it, e.g. per test)."""
    engine = make_engine(tiny_chat_model)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def endpoint(server):
    from radixserve.frontend_lang import RuntimeEndpoint

    return RuntimeEndpoint(server.url)


@pytest.fixture(params=["engine", "endpoint"])
def backend(request, engine):
    """The in-process engine backend, then the HTTP one, for tests that take `backend`."""
    from radixserve.frontend_lang import EngineBackend

    if request.param == "engine":
        return EngineBackend(engine)
    return request.getfixturevalue("endpoint")
