"""benchmarks/paged_decode_kernel.py runs end to end on a tiny case and writes every row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import paged_decode_kernel  # noqa: E402


def test_writes_a_row_per_case(cpu_ops, tmp_path):
    out = tmp_path / "kernel.json"
    argv = ["--batches", "1,2", "--contexts", "17", "--repeats", "1", "--out", str(out)]
    paged_decode_kernel.main(argv)
    rows = json.loads(out.read_text())["rows"]
    cases = {(r["batch"], r["layout"], r["kv_dtype"]) for r in rows}
    assert len(rows) == len(cases) == 2 * 2 * 2
    assert all(r["ms"] > 0 for r in rows)
