"""benchmarks/scoring.py runs end to end on a tiny model: a row per system and call, its
machine named, and radixserve's label probabilities agreeing with transformers'."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scoring  # noqa: E402


def test_writes_a_row_per_system_and_call(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "scoring.json"
    argv = ["--model", tiny_chat_model, "--items", "3", "--query-len", "40", "--rounds", "1"]
    scoring.main([*argv, "--out", str(out)])
    record = json.loads(out.read_text())
    systems = {"radixserve", "radixserve-no-cache", "transformers"}
    assert {(r["system"], r["call"]) for r in record["rows"]} == {
        (s, c) for s in systems for c in ("cold", "warm")
    }
    assert all(r["items_per_s"] > 0 for r in record["rows"])
    assert record["max_logprob_diff"] < 1e-3
    assert record["cpu"] in capsys.readouterr().out
