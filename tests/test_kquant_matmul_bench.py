"""benchmarks/kquant_matmul.py runs end to end on a small case, names its machine and writes
a row per case and row count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kquant_matmul  # noqa: E402


def test_writes_a_row_per_case_and_row_count(cpu_ops, tmp_path, capsys):
    out = tmp_path / "kquant.json"
    argv = ["--rows", "1,3", "--stream-mb", "1", "--repeats", "1", "--cases", "0,2"]
    kquant_matmul.main([*argv, "--out", str(out)])
    record = json.loads(out.read_text())
    assert {(r["type"], r["m"]) for r in record["rows"]} == {
        ("Q4_K", 1),
        ("Q4_K", 3),
        ("Q6_K", 1),
        ("Q6_K", 3),
    }
    assert all(r["torch_us"] > 0 and r["kquant_gb_s"] > 0 for r in record["rows"])
    assert cpu_ops.simd_level() in record["machine"]
    assert record["machine"] in capsys.readouterr().out
