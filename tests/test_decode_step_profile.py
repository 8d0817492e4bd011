"""benchmarks/decode_step_profile.py with two quantizations alternated, on a tiny model: one
row per method, each split into its parts, the first method's speed-up over each; with
--q4k-layouts a row per layout too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import decode_step_profile  # noqa: E402


def test_alternated_methods_each_get_a_row(tiny_chat_model, tmp_path):
    out = tmp_path / "profile.json"
    argv = ["--model", tiny_chat_model, "--quantization", "none,int4", "--q4k-layouts", "x8,rows"]
    argv += ["--batches", "1", "--context", "8", "--steps", "2", "--rounds", "2"]
    decode_step_profile.main(argv + ["--out", str(out)])
    data = json.loads(out.read_text())
    assert data["rounds"] == 2 and data["cpu"] and data["clock"] == "thread CPU time"
    rows = {r["quantization"]: r for r in data["rows"]}
    assert list(rows) == ["none", "none:rows", "int4", "int4:rows"]
    assert rows["none"]["x_first"] == 1.0
    for row in rows.values():
        assert row["step"] > 0 and row["matmul"] > 0
    assert rows["int4"]["x_first"] == rows["none"]["step"] / rows["int4"]["step"]
