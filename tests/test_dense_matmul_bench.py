"""benchmarks/dense_matmul.py runs end to end on a small case, names its machine and writes
a row per shape and row count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import dense_matmul  # noqa: E402


def test_writes_a_row_per_shape_and_row_count(cpu_ops, tmp_path, capsys):
    out = tmp_path / "dense.json"
    argv = ["--rows", "1,3", "--layers", "2", "--repeats", "1", "--shapes", "o,down"]
    dense_matmul.main([*argv, "--out", str(out)])
    record = json.loads(out.read_text())
    assert {(r["shape"], r["m"]) for r in record["rows"]} == {
        ("o", 1),
        ("o", 3),
        ("down", 1),
        ("down", 3),
    }
    assert all(r["torch_us"] > 0 and r["ours_us"] > 0 and r["ratio"] > 0 for r in record["rows"])
    assert cpu_ops.simd_level() in record["machine"]
    assert record["machine"] in capsys.readouterr().out
