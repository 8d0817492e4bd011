"""GPU device check: correctness and speed of everything GPU-side, in one run.

Sections (each skipped with a reason when its dependency is missing):
  1. device: copy bandwidth (GB/s) and bf16 matmul rate (TFLOP/s)
  2. kernels: Triton decode / extend / KV-store vs their torch references at realistic bf16
     shapes, then timings (triton.testing.do_bench) as % of the measured copy bandwidth
  3. engine: dummy-weight Llama-3-8B shape in bf16 through the real scheduler: decode tok/s
     at batch 1/16/64/256, prefill tok/s, triton vs torch_native attention
  4. transformers: `generate` on the same shape at batch 1 and 64, for comparison
Prints one summary table last and writes every number as JSON into OUT_DIR.

Run:  bash benchmarks/gpu/check.sh OUT_DIR            (on the GPU machine, no network)
      python benchmarks/gpu/check.py OUT_DIR --smoke  (CPU: tiny shapes, checks the script)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # runs from a plain checkout: the package need not be installed
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run on CPU, slowly

RESULTS: dict = {}


def section(name: str):
    """Runs a section, recording its numbers or the error that stopped it."""

    def wrap(fn):
        def run(*args):
            start = time.perf_counter()
            try:
                RESULTS[name] = fn(*args)
            except Exception as exc:  # keep going: one broken section must not hide the rest
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            print(f"[{name}] {time.perf_counter() - start:.1f}s: {RESULTS[name]}", flush=True)

        return run

    return wrap


def timed(fn, device: str, repeats: int = 5) -> float:
    """Median seconds of fn() (triton's do_bench on CUDA)."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn) / 1e3
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@section("device")
def device_rates(device: str, smoke: bool) -> dict:
    n = (1 << 20) if smoke else (1 << 28)  # elements of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device)
    size = 256 if smoke else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    mm_s = timed(lambda: a @ a, device)
    return {"copy_GBps": 2 * n * 2 / copy_s / 1e9, "bf16_matmul_TFLOPs": 2 * size**3 / mm_s / 1e12}


def _paged(num_reqs, seq_len, page_size, heads, kv_heads, dim, device, dtype):
    pages = -(-seq_len // page_size)
    perm = torch.randperm(num_reqs * pages, device=device) + 1
    table = perm.view(num_reqs, pages)
    slots = (num_reqs * pages + 1) * page_size
    k = torch.randn(slots, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.full((num_reqs,), seq_len, device=device)
    return table, k, v, lens


@section("kernels")
def kernels(device: str, smoke: bool) -> dict:
    from radixserve_kernels import paged_decode, paged_extend, reference

    reqs, seq, ps = (4, 100, 16) if smoke else (64, 4096, 16)
    heads, kv_heads, dim = (8, 2, 64) if smoke else (32, 8, 128)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    table, k, v, lens = _paged(reqs, seq, ps, heads, kv_heads, dim, device, dtype)
    q = torch.randn(reqs, heads, dim, device=device, dtype=dtype)
    decode = lambda: paged_decode.paged_decode_attention(q, k, v, table, lens, ps)  # noqa: E731
    err = decode().float() - reference.paged_decode_attention_ref(q, k, v, table, lens, ps).float()
    decode_s = timed(decode, device)
    kv_bytes = 2 * reqs * seq * kv_heads * dim * k.element_size()
    ext = 8 if smoke else 512
    qe = torch.randn(reqs * ext, heads, dim, device=device, dtype=dtype)
    starts = torch.arange(reqs, device=device) * ext
    prefix, extend = lens - ext, torch.full_like(lens, ext)
    run_ext = lambda: paged_extend.paged_extend_attention(  # noqa: E731
        qe, k, v, table, starts, prefix, extend, ext, ps)  # fmt: skip
    want = reference.paged_extend_attention_ref(
        qe, k, v, table, prefix.tolist(), extend.tolist(), ps)  # fmt: skip
    ext_err = (run_ext().float() - want.float()).abs().max().item()
    ext_s = timed(run_ext, device)
    return {
        "decode_max_abs_err": err.abs().max().item(),
        "decode_ms": decode_s * 1e3,
        "decode_GBps": kv_bytes / decode_s / 1e9,
        "extend_max_abs_err": ext_err,
        "extend_ms": ext_s * 1e3,
        "extend_TFLOPs": 4 * reqs * ext * seq * heads * dim / ext_s / 1e12,
    }


def _scheduler(model: str, backend: str, device: str, dtype: str, tokens: int):
    from radixserve.cache.radix_cache import create_prefix_cache
    from radixserve.config import CacheConfig, LoadConfig, SchedulerConfig
    from radixserve.engine.scheduler import Scheduler
    from radixserve.model.runner import ModelRunner

    load = LoadConfig(model=model, load_format="dummy", dtype=dtype, device=device)
    cache = CacheConfig(max_total_tokens=tokens, attention_backend=backend)
    runner = ModelRunner.create(load, cache)
    prefix_cache = create_prefix_cache(False, runner.pool.allocator, runner.pool.page_size)
    return Scheduler(runner, prefix_cache, SchedulerConfig(max_running_requests=512))


def _run(scheduler, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) for `batch` random prompts through the real scheduler."""
    from radixserve.engine.request import Req
    from radixserve.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    vocab = scheduler.runner.config.vocab_size
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt_len,)).tolist()
        scheduler.add_request(Req(rid=f"r{i}", input_ids=ids, params=params, seed=i))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    start = time.perf_counter()
    while any(len(r.output_ids) == 0 for r in scheduler.running) or scheduler.waiting or \
            scheduler.inbox:  # fmt: skip
        scheduler.step()
    sync()
    prefill_s, start = time.perf_counter() - start, time.perf_counter()
    while scheduler.has_work():
        scheduler.step()
    sync()
    decode_s = time.perf_counter() - start
    return batch * prompt_len / prefill_s, batch * (new_tokens - 1) / max(decode_s, 1e-9)


@section("engine")
def engine(device: str, smoke: bool) -> dict:
    model = "smollm2-135m" if smoke else "llama-3-8b"
    dtype = "float32" if device == "cpu" else "bfloat16"
    backends = ["torch_native"] + ([] if device == "cpu" else ["triton"])
    batches = [1, 4] if smoke else [1, 16, 64, 256]
    prompt, new = (32, 8) if smoke else (512, 64)
    out = {}
    for backend in backends:
        scheduler = _scheduler(model, backend, device, dtype, max(batches) * (prompt + new) + 64)
        for batch in batches:
            prefill, decode = _run(scheduler, batch, prompt, new)
            out[f"{backend}_b{batch}"] = {"prefill_tok_s": prefill, "decode_tok_s": decode}
        del scheduler
        if device == "cuda":
            torch.cuda.empty_cache()
    out["cuda_graphs"] = "not implemented yet"
    return out


@section("transformers")
def transformers_generate(device: str, smoke: bool) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from radixserve.model.source import builtin_config

    cfg = builtin_config("smollm2-135m" if smoke else "llama-3-8b")
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    prompt, new = (32, 8) if smoke else (512, 64)
    out = {}
    for batch in [1, 4] if smoke else [1, 64]:
        ids = torch.randint(0, config.vocab_size, (batch, prompt), device=device)
        kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(ids, **kwargs)
            out[f"b{batch}_tok_s"] = batch * new / (time.perf_counter() - start)
    return out


def summary() -> None:
    print("\n=== summary ===")
    for name, values in RESULTS.items():
        for key, value in values.items() if isinstance(values, dict) else [("", values)]:
            print(f"{name:13} {key:28} {value}")


def import_kernels_package() -> None:
    """Makes kernels/ importable as radixserve_kernels without installing the package."""
    try:
        import radixserve_kernels  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "radixserve_kernels", ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")],
        )  # fmt: skip
        module = importlib.util.module_from_spec(spec)
        sys.modules["radixserve_kernels"] = module
        spec.loader.exec_module(module)


def main() -> None:
    import_kernels_package()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    RESULTS["env"] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for run in (device_rates, kernels, engine, transformers_generate):
        run(device, args.smoke)
    summary()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2, default=str))


if __name__ == "__main__":
    main()
