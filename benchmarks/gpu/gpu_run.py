"""The GPU check's harness (check.py): the shapes of a full and a smoke run, the run's clock,
the `section` decorator that records each section's numbers (or its error, or why it was
skipped) into RESULTS and writes them out after every section, and the timing helpers."""

from __future__ import annotations

import gc
import importlib.util
import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

RESULTS: dict[str, Any] = {}


@dataclass(frozen=True)
class Shapes:
    model: str
    batches: tuple[int, ...]  # scheduler runs
    prompt: int
    new: int
    decode_batches: tuple[int, ...]  # bare decode steps at decode_context
    decode_context: int
    prefill_reqs: int  # one prefill step of prefill_reqs x prefill_len tokens
    prefill_len: int
    kernel: tuple[int, int, int, int, int, int, int]  # reqs, seq, page, heads, kv_heads, dim, ext
    graph_context: int  # positions a decode graph covers (Llama-3-8B: 8192)
    hf_batches: tuple[int, ...]
    shared_prefix: dict[str, int] | None  # overrides of the bench's small preset
    quant_weights: tuple[tuple[int, int], ...]  # (out, in) of the quantized matmuls
    quant_m: tuple[int, ...]  # their activation rows: decode, prefill


FULL = Shapes("llama-3-8b", (1, 16, 64, 256), 512, 64, (1, 64), 4096, 8, 1024,
              (64, 4096, 16, 32, 8, 128, 512), 8192, (1, 64), None,
              ((576, 1536), (4096, 4096)), (1, 512))  # fmt: skip
SMOKE = Shapes("tiny-llama", (1, 4), 32, 8, (1, 4), 48, 2, 16, (2, 40, 16, 4, 2, 16, 8), 128,
               (1, 4), dict(num_groups=2, prompts_per_group=2, system_len=48, question_len=8,
                            output_len=4), ((40, 128), (48, 256)), (1, 17))  # fmt: skip
TINY_LLAMA = {  # --smoke: a dummy-weight model small enough for the CPU
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


@dataclass
class Run:
    device: str
    shapes: Shapes
    out_dir: Path
    deadline: float
    loaded: Any = None  # the dummy model, shared by the engine and shared-prefix sections
    notes: list[str] = field(default_factory=list)

    @property
    def dtype(self) -> str:
        return "float32" if self.device == "cpu" else "bfloat16"

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def rate(self, key: str) -> float | None:
        """A rate measured by the device section (None if it failed)."""
        return RESULTS.get("device", {}).get(key)


def section(name: str, min_left_s: float):
    """Runs a section unless less than `min_left_s` remains; records its numbers or error."""

    def wrap(fn):
        def run(ctx: Run) -> None:
            start = time.perf_counter()
            if ctx.left() < min_left_s:
                RESULTS[name] = {"skipped": f"out of time ({ctx.left():.0f}s left)"}
            else:
                try:
                    RESULTS[name] = fn(ctx)
                except Exception as exc:  # one broken section must not hide the rest
                    RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc()
            print(f"[{name}] {time.perf_counter() - start:.1f}s: {RESULTS[name]}", flush=True)
            write_json(ctx.out_dir)

        return run

    return wrap


def write_json(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2, default=str))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Seconds per fn(): triton's do_bench on CUDA (mean after warm-up, L2 flushed between
    calls); on CPU, where only the script itself is under test, one call."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def skip_reason_flashinfer(device: str) -> str | None:
    if device != "cuda":
        return "flashinfer needs CUDA"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer not installed (pip install flashinfer-python)"
    return None


def paged_kv(num_reqs: int, seq_len: int, page_size: int, kv_heads: int, dim: int, device: str,
             dtype: torch.dtype) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A random paged K/V cache: each request's `seq_len` positions on shuffled pages of its
    own (page 0 unused) -> (page table, k, v, seq lens)."""
    pages = -(-seq_len // page_size)
    perm = torch.randperm(num_reqs * pages, device=device) + 1
    table = perm.view(num_reqs, pages)
    slots = (num_reqs * pages + 1) * page_size
    k = torch.randn(slots, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.full((num_reqs,), seq_len, device=device)
    return table, k, v, lens
