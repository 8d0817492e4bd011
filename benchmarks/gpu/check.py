"""GPU device check: correctness and speed of everything GPU-side in one run, against rooflines.

Sections (each one skipped with a reason when a dependency is missing or time runs short):
  1. device: copy bandwidth (GB/s) and bf16 matmul rate (TFLOP/s), the rooflines' rates
  2. kernels: Triton decode (eager and CUDA-graph chunking) / extend vs their torch references
     at batch 64 x 4k context of Llama-3-8B heads, timed as % of the copy bandwidth; FlashInfer's
     decode beside them when it is installed
     quant_kernels: Triton int4 / int8 dequant-GEMMs vs their references, timed beside a bf16
     matmul and torch's int8 kernel, M=1 and 512, weights 576x1536 and 4096x4096 (gpu_quant.py)
     model_kernels: Triton fused MoE, segmented multi-LoRA, extend with draft trees and with
     soft-capping, each vs its torch reference (gpu_model_kernels.py)
  3. engine: dummy-weight Llama-3-8B in bf16 per attention backend, with and without CUDA
     graphs: the real scheduler at batch 1/16/64/256 (prefill tok/s, decode tok/s, decode step
     vs its roofline), a bare decode step at batch 1 and 64 x 4k context, an 8k-token prefill step
     speculative: EAGLE3 (a random head in SGLang's layout at the model's shapes, chain and
     tree, always drafting) against plain decoding at batch 1 and 16: a speculative step's
     time in plain steps, and greedy tokens identical (gpu_speculative.py)
  4. shared_prefix: the shared-prefix bench's small preset, radix cache vs none
  5. transformers: HF `generate` on the same shape at batch 1 and 64
  6. tensor_parallel: only where more than one GPU is visible: benchmarks/tp_scaling.py on
     dummy Llama-3-8B at tp 1/2/4/8 (nccl), prefill / decode tok/s against the per-device
     roofline, greedy tokens checked against tp 1
Prints the tables and the targets last (gpu_report.py); writes every number as JSON into
OUT_DIR after each section, so a run cut short still leaves what it measured.

Run:  bash benchmarks/gpu/check.sh OUT_DIR            (GPU machine: torch, triton, transformers)
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
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "gpu")]  # a plain checkout: nothing installed
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run on CPU, slowly

from gpu_engine import engine  # noqa: E402
from gpu_model_kernels import model_kernel_rows  # noqa: E402
from gpu_quant import quant_matmul_rows  # noqa: E402
from gpu_report import summary_text  # noqa: E402
from gpu_run import (  # noqa: E402
    FULL,
    RESULTS,
    SMOKE,
    TINY_LLAMA,
    Run,
    Shapes,
    free_memory,
    paged_kv,
    section,
    skip_reason_flashinfer,
    sync,
    timed,
    write_json,
)
from gpu_speculative import speculative  # noqa: E402

# ---- 1. device ---------------------------------------------------------------------------


@section("device", min_left_s=10)
def device_rates(run: Run) -> dict:
    n = (1 << 20) if run.device == "cpu" else (1 << 28)  # bf16 elements: 512 MiB per buffer
    src = torch.empty(n, dtype=torch.bfloat16, device=run.device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), run.device)
    size = 256 if run.device == "cpu" else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=run.device)
    mm_s = timed(lambda: a @ a, run.device)
    return {"copy_GBps": 2 * n * 2 / copy_s / 1e9, "bf16_matmul_TFLOPs": 2 * size**3 / mm_s / 1e12}


# ---- 2. kernels --------------------------------------------------------------------------


@section("kernels", min_left_s=30)
def kernels(run: Run) -> dict:
    from radixserve.attention.triton_backend import graph_decode_splits
    from radixserve_kernels import paged_decode, paged_extend, reference

    reqs, seq, ps, heads, kv_heads, dim, ext = run.shapes.kernel
    dtype = torch.float32 if run.device == "cpu" else torch.bfloat16
    table, k, v, lens = paged_kv(reqs, seq, ps, kv_heads, dim, run.device, dtype)
    q = torch.randn(reqs, heads, dim, device=run.device, dtype=dtype)
    want = reference.paged_decode_attention_ref(q, k, v, table, lens, ps).float()
    kv_bytes = 2 * reqs * seq * kv_heads * dim * k.element_size()
    out = {"shape": f"{reqs} reqs x {seq} ctx, {heads}/{kv_heads} heads x {dim}"}

    def decode_stats(name: str, fn) -> None:
        seconds = timed(fn, run.device)
        out[f"{name}_max_abs_err"] = (fn().float() - want).abs().max().item()
        out[f"{name}_ms"] = seconds * 1e3
        out[f"{name}_GBps"] = kv_bytes / seconds / 1e9

    decode_stats("decode", lambda: paged_decode.paged_decode_attention(q, k, v, table, lens, ps))
    splits, split_len = graph_decode_splits(run.shapes.graph_context)  # as a decode graph does
    decode_stats("decode_graph", lambda: paged_decode.paged_decode_attention(
        q, k, v, table, lens, ps, split_len=split_len, num_splits=splits))  # fmt: skip
    reason = skip_reason_flashinfer(run.device)
    if reason:
        out["flashinfer"] = f"skipped: {reason}"
    else:
        decode_stats("flashinfer_decode", _flashinfer_decode(q, k, v, table, lens, ps))
    qe = torch.randn(reqs * ext, heads, dim, device=run.device, dtype=dtype)
    starts = torch.arange(reqs, device=run.device) * ext
    prefix, extend = lens - ext, torch.full_like(lens, ext)
    run_ext = lambda: paged_extend.paged_extend_attention(  # noqa: E731
        qe, k, v, table, starts, prefix, extend, ext, ps)  # fmt: skip
    want_ext = reference.paged_extend_attention_ref(
        qe, k, v, table, prefix.tolist(), extend.tolist(), ps)  # fmt: skip
    out["extend_max_abs_err"] = (run_ext().float() - want_ext.float()).abs().max().item()
    ext_s = timed(run_ext, run.device)
    out["extend_ms"] = ext_s * 1e3
    out["extend_TFLOPs"] = 4 * reqs * ext * seq * heads * dim / ext_s / 1e12
    return out


def _flashinfer_decode(q, k, v, table, lens, ps):
    """FlashInfer's decode over the same pages, planned once (as the backend does per step)."""
    from radixserve.attention.flashinfer_backend import import_flashinfer, paged_kv_plan_inputs

    flashinfer = import_flashinfer()
    reqs, heads, dim = q.shape
    kv_heads = k.shape[1]
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=heads // kv_heads >= 4
    )
    inputs = paged_kv_plan_inputs(table, lens.tolist(), [1] * reqs, ps)
    wrapper.plan(inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len, heads, kv_heads,
                 dim, ps, q_data_type=q.dtype, kv_data_type=k.dtype)  # fmt: skip
    pages = (-1, ps, kv_heads, dim)
    return lambda: wrapper.run(q, (k.view(pages), v.view(pages)))


@section("quant_kernels", min_left_s=30)
def quant_kernels(run: Run) -> dict:
    dtype = torch.float32 if run.device == "cpu" else torch.bfloat16
    s = run.shapes
    return quant_matmul_rows(s.quant_weights, s.quant_m, run.device, dtype,
                             lambda fn: timed(fn, run.device))  # fmt: skip


@section("model_kernels", min_left_s=30)
def model_kernels(run: Run) -> dict:
    dtype = torch.float32 if run.device == "cpu" else torch.bfloat16
    smoke = run.shapes.model != FULL.model
    return model_kernel_rows(run.device, dtype, smoke, lambda fn: timed(fn, run.device))


# ---- 4. shared prefix --------------------------------------------------------------------


class WordTokenizer:
    """Stands in for a real tokenizer (none ships on the GPU machine): a stable id per word."""

    def __init__(self, vocab_size: int):
        self.low = min(1000, vocab_size // 2)
        self.span = vocab_size - self.low

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.low + zlib.crc32(word.encode()) % self.span for word in text.split()]


@section("shared_prefix", min_left_s=45)
def shared_prefix(run: Run) -> dict:
    from radixserve.config import CacheConfig, LoadConfig
    from radixserve.model.runner import ModelRunner
    from radixserve_bench.hit_rate import max_hit_rate
    from radixserve_bench.workloads import make_workload

    if run.loaded is None:
        return {"skipped": "the engine section did not load the model"}
    tokenizer = WordTokenizer(run.loaded.config.vocab_size)
    workload = make_workload("shared-prefix", tokenizer, 0, "small", run.shapes.shared_prefix)
    prompts = workload.prompts()
    output_len = workload.requests[0].output_len
    load = LoadConfig(model=run.shapes.model, load_format="dummy", dtype=run.dtype,
                      device=run.device)  # fmt: skip
    tokens = sum(len(p) + output_len for p in prompts) + 4096
    cache = CacheConfig(max_total_tokens=tokens, cuda_graph_max_bs=len(prompts))
    runner = ModelRunner.from_loaded(run.loaded, load, cache)
    rows = {name: _serve(runner, prompts, output_len, disable) for name, disable
            in (("radix", False), ("none", True))}  # fmt: skip
    optimum = max_hit_rate(prompts, runner.pool.page_size)
    same = rows["radix"].pop("output_ids") == rows["none"].pop("output_ids")
    return {
        "workload": f"{len(prompts)} prompts, " + ", ".join(
            f"{k}={v}" for k, v in workload.config.items() if k not in ("seed",)),
        "max_hit_rate": optimum,
        "radix": rows["radix"] | {"hit_rate_of_max": rows["radix"]["hit_rate"] / optimum},
        "none": rows["none"],
        "speedup": rows["none"]["wall_s"] / rows["radix"]["wall_s"],
        "same_outputs": same,
    }  # fmt: skip


def _serve(runner, prompts: list[list[int]], output_len: int, disable_cache: bool) -> dict:
    from radixserve.cache.radix_cache import create_prefix_cache
    from radixserve.config import SchedulerConfig
    from radixserve.engine.request import Req
    from radixserve.engine.scheduler import Scheduler
    from radixserve.sampling.params import SamplingParams

    cache = create_prefix_cache(disable_cache, runner.pool.allocator, runner.pool.page_size)
    scheduler = Scheduler(runner, cache, SchedulerConfig())
    params = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    reqs = [Req(rid=f"p{i}", input_ids=p, params=params, seed=i) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for req in reqs:
        scheduler.add_request(req)
    while scheduler.has_work():
        scheduler.step()
    sync(runner.device.type)
    wall = time.perf_counter() - start
    stats = scheduler.stats
    cache.reset()  # hand the pages back for the next system
    return {
        "wall_s": wall,
        "prefill_tokens_computed": stats.prefill_tokens_computed,
        "hit_rate": stats.cache_hit_rate,
        "output_tok_s": sum(len(r.output_ids) for r in reqs) / wall,
        "output_ids": [r.output_ids for r in reqs],
    }


# ---- 5. transformers ---------------------------------------------------------------------


@section("transformers", min_left_s=45)
def transformers_generate(run: Run) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    run.loaded = None  # the engine's copy of the weights goes before HF's arrives
    free_memory()
    cfg = model_config_dict(run.shapes.model)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    dtype = torch.float32 if run.device == "cpu" else torch.bfloat16
    with torch.device(run.device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.eval()
    s, out = run.shapes, {}
    for batch in s.hf_batches:
        if run.left() < 20:
            out[f"b{batch}_tok_s"] = f"skipped: out of time ({run.left():.0f}s left)"
            continue
        ids = torch.randint(0, config.vocab_size, (batch, s.prompt), device=run.device)
        with torch.inference_mode():
            _hf_generate(model, ids[:, :16], 2)  # warm-up
            sync(run.device)
            start = time.perf_counter()
            _hf_generate(model, ids, s.new)
            sync(run.device)
            out[f"b{batch}_tok_s"] = batch * s.new / (time.perf_counter() - start)
    return out


def _hf_generate(model, ids: torch.Tensor, new_tokens: int) -> None:
    """Greedy, exactly `new_tokens` new tokens per row (no early stop)."""
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip


# ---- main --------------------------------------------------------------------------------


def import_kernels_package() -> None:
    """Makes this checkout's radixserve_kernels/ the one imported, installed or not (an
    installed one may be another checkout's)."""
    spec = importlib.util.spec_from_file_location(
        "radixserve_kernels", ROOT / "radixserve_kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "radixserve_kernels")],
    )  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules["radixserve_kernels"] = module
    spec.loader.exec_module(module)


def model_config_dict(model: str) -> dict[str, Any]:
    """The HF config of a built-in config name or of a model folder."""
    from radixserve.model.source import builtin_config

    folder = Path(model)
    if folder.is_dir():
        return json.loads((folder / "config.json").read_text())
    return builtin_config(model)


def smoke_shapes(out_dir: Path) -> Shapes:
    """SMOKE, its tiny model written as a config-only HF folder (dummy weights) in out_dir."""
    folder = out_dir / "tiny-llama"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return replace(SMOKE, model=str(folder))


@section("tensor_parallel", min_left_s=90)
def tensor_parallel(ctx: Run) -> dict[str, Any]:
    """benchmarks/tp_scaling.py in its own process (its ranks are spawned processes)."""
    import subprocess

    gpus = torch.cuda.device_count() if ctx.device == "cuda" else 0
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s) visible; tensor parallelism needs 2 or more"}
    sizes = ",".join(str(n) for n in (1, 2, 4, 8) if n <= gpus)
    out = ctx.out_dir / "tp_scaling.json"
    script = ROOT / "benchmarks" / "tp_scaling.py"
    cmd = [sys.executable, str(script), "--model", ctx.shapes.model, "--tp-sizes", sizes]
    cmd += ["--repeats", "3", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=max(ctx.left() - 10, 30))
    return json.loads(out.read_text())


def main() -> None:
    import_kernels_package()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--budget-s", type=float, default=440.0,
                        help="start no work after this many seconds (check.sh: 470)")  # fmt: skip
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = Path(args.out_dir)
    shapes = smoke_shapes(out_dir) if args.smoke else FULL
    run = Run(device, shapes, out_dir, time.perf_counter() + args.budget_s)
    RESULTS["env"] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu {platform.machine()}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shapes": "smoke" if args.smoke else "full",
    }
    steps = (
        device_rates, kernels, quant_kernels, model_kernels, engine, speculative, shared_prefix,
        transformers_generate, tensor_parallel,
    )  # fmt: skip
    for step in steps:
        step(run)
    RESULTS["total_s"] = args.budget_s - run.left()
    write_json(run.out_dir)
    print(summary_text(RESULTS))


if __name__ == "__main__":
    main()
