"""benchmarks/quant_quality.py end to end on a tiny random model: shape of its JSON, and the
fp32 reference agreeing with itself."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import quant_quality  # noqa: E402


def test_quant_quality_smoke(tiny_chat_model, tmp_path):
    out = tmp_path / "quality.json"
    argv = ["--model", tiny_chat_model, "--modes", "none,int8", "--max-tokens", "96"]
    argv += ["--window", "64", "--stride", "32", "--greedy-tokens", "8", "--num-prompts", "2"]
    data = quant_quality.main(argv + ["--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == ["none", "int8"]
    assert all(r["num_scored_tokens"] == 95 for r in rows.values())  # every token but the first
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in rows.values())
    assert rows["none"]["dtype"] == "float32" and rows["int8"]["dtype"] == "float32/bf16"
    assert rows["none"]["top1_agreement"] == 1.0 and rows["none"]["greedy_agreement"] == 1.0
    assert 0 <= rows["int8"]["top1_agreement"] <= 1
    assert [t["target"] for t in data["targets"]] == ["int8 perplexity within 1% of fp32"]
    assert rows["int8"]["reference"] == "fp32" and 0 <= rows["int8"]["greedy_prefix_fraction"] <= 1
    assert data["cpu"]  # the machine named beside the numbers


def test_windows_score_every_token_once():
    spans = quant_quality.windows(300, window=128, stride=64)
    scored = [i for _, end, first in spans for i in range(first, end)]
    assert scored == list(range(1, 300))
    assert all(end - start <= 128 and first - start >= 64 for start, end, first in spans[1:])


def test_mode_suffixes_name_the_group_size_and_the_head():
    assert quant_quality.mode_options("int4:g64:head") == {
        "quantization": "int4",
        "quantization_group_size": 64,
        "quantize_lm_head": True,
    }
    assert quant_quality.mode_options("int8")["quantization_group_size"] is None
    assert quant_quality.mode_options("gguf:act-int8:kernels") == {
        "quantization": "gguf",
        "quantization_group_size": None,
        "cpu_quant_activation": "int8",
        "enable_deterministic_inference": True,
    }
    assert quant_quality.reference_label(None).startswith("the file's")  # the Q4_1 default
    assert quant_quality.reference_label("/models/plain-hf-folder") == "fp32"
