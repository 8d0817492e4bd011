"""The device check's closing summary: one table per section, then the targets, each
measurement printed beside its roofline (or HF transformers' rate) and the ratio to it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DECODE_GOAL = "<= 1.5x"  # decode step with CUDA graphs, vs weights + KV read once
PREFILL_GOAL = "<= 1.5x"  # prefill step at 8k tokens, vs the matmul roofline
KERNEL_GOAL = ">= 75%"  # decode attention kernel, of the measured copy bandwidth


@dataclass(frozen=True)
class Target:
    """One line of the targets table: a measurement beside its bound and the goal."""

    name: str
    measured: str
    bound: str
    ratio: float | None
    goal: str  # "<= 1.5x", ">= 75%" or "report"

    def status(self) -> str:
        if self.ratio is None:
            return "n/a"
        if self.goal.startswith("<="):
            return "ok" if self.ratio <= float(self.goal[2:].strip(" x")) else "MISS"
        if self.goal.startswith(">="):
            return "ok" if self.ratio * 100 >= float(self.goal[2:].strip(" %")) else "MISS"
        return ""

    def ratio_text(self) -> str:
        if self.ratio is None:
            return "-"
        return f"{self.ratio * 100:.0f}%" if "%" in self.goal else f"{self.ratio:.2f}x"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """First column left-aligned, the others right-aligned; floats to 3 significant digits."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [_line(headers, widths), _line(["-" * w for w in widths], widths)]
    return "\n".join(lines + [_line(row, widths) for row in cells])


def _line(values: Sequence[str], widths: Sequence[int]) -> str:
    parts = [f"{values[0]:<{widths[0]}}"] + [f"{v:>{w}}" for v, w in zip(values[1:], widths[1:])]
    return "  ".join(parts).rstrip()


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def _ok(section: Any) -> dict:
    """A section's numbers, or {} when it was skipped or failed."""
    return section if isinstance(section, dict) and not _problem(section) else {}


def _problem(section: Any) -> str | None:
    """Why a section or part has no numbers: its error, or the reason it was skipped."""
    if isinstance(section, dict):
        return section.get("error") or section.get("skipped")
    if isinstance(section, str) and section.startswith("skipped"):
        return section
    return None


def _configs(results: dict) -> dict[str, dict]:
    engine = _ok(results.get("engine"))
    return {k: v for k, v in engine.items() if isinstance(v, dict) and not _problem(v)}


# ---- section tables ----------------------------------------------------------------------


def device_text(results: dict) -> str:
    dev = _ok(results.get("device"))
    if not dev:
        return "device: -"
    return (f"device: copy {dev['copy_GBps']:,.0f} GB/s (read + write), "
            f"bf16 matmul {dev['bf16_matmul_TFLOPs']:,.1f} TFLOP/s")  # fmt: skip


def kernels_table(results: dict) -> str:
    kern = _ok(results.get("kernels"))
    if not kern:
        return "kernels: -"
    copy = _ok(results.get("device")).get("copy_GBps")
    rows = []
    for name in ("decode", "decode_graph", "flashinfer_decode"):
        if f"{name}_ms" in kern:
            share = f"{kern[f'{name}_GBps'] / copy:.0%}" if copy else None
            rows.append([name, kern[f"{name}_ms"], kern[f"{name}_GBps"], share,
                         kern[f"{name}_max_abs_err"]])  # fmt: skip
    rows.append(["extend", kern["extend_ms"], f"{kern['extend_TFLOPs']:.3g} TFLOP/s", None,
                 kern["extend_max_abs_err"]])  # fmt: skip
    title = f"kernels ({kern.get('shape', '')})"
    return title + "\n" + format_table(["kernel", "ms", "GB/s", "of copy", "max abs err"], rows)


def quant_table(results: dict) -> str:
    """The Triton dequant-GEMMs (gpu_quant.py) beside a dense matmul in the model dtype."""
    quant = _ok(results.get("quant_kernels"))
    rows = [[key, r["ms"], r["dense_ms"], r["x_dense"], r["weight_GBps"], r["rel_err"]]
            for key, r in quant.items() if not _problem(r)]  # fmt: skip
    if not rows:
        return "quantized matmuls: -"
    headers = ["kernel, weight (out x in), M", "ms", "dense ms", "x dense", "weight GB/s",
               "rel err"]  # fmt: skip
    title = "quantized matmuls (x dense > 1: faster than the unquantized matmul)"
    return title + "\n" + format_table(headers, rows)


def model_kernels_table(results: dict) -> str:
    """The MoE / LoRA / tree / soft-cap Triton kernels (gpu_model_kernels.py)."""
    rows = [[key, r["ms"], r["rel_err"], r["shape"]]
            for key, r in _ok(results.get("model_kernels")).items() if not _problem(r)]  # fmt: skip
    if not rows:
        return "model kernels: -"
    return "model kernels\n" + format_table(["kernel", "ms", "rel err", "shape"], rows)


def speculative_table(results: dict) -> str:
    """EAGLE3 with a random head against plain decoding (gpu_speculative.py)."""
    rows = []
    for mode, row in _ok(results.get("speculative")).items():
        for key, r in row.items() if isinstance(row, dict) and not _problem(row) else ():
            if isinstance(r, dict) and "step_ms" in r:
                rows.append([mode, key, r["step_ms"], r.get("step_x_plain"), r["forwards"],
                             r.get("accept_length"), r.get("identical")])  # fmt: skip
    if not rows:
        return "speculative: -"
    headers = ["mode", "batch", "step ms", "x plain step", "forwards", "accept len", "identical"]
    return "speculative (random EAGLE3 head: drafts rejected, costs shown)\n" + format_table(
        headers, rows
    )


def scheduler_table(results: dict) -> str:
    hf = _ok(results.get("transformers"))
    rows = []
    for name, cfg in _configs(results).items():
        for key, row in _ok(cfg.get("scheduler")).items():
            if _problem(row):
                rows.append([name, key, _problem(row)] + [None] * 8)
                continue
            hf_rate = hf.get(f"{key}_tok_s")
            hf_rate = hf_rate if isinstance(hf_rate, float) else None
            rows.append([name, key, row["prefill_tok_s"], row["decode_tok_s"],
                         row["decode_step_ms"], row.get("roofline_ms"), row.get("x_roofline"),
                         row["e2e_tok_s"], hf_rate,
                         row["e2e_tok_s"] / hf_rate if hf_rate else None])  # fmt: skip
    headers = ["config", "batch", "prefill tok/s", "decode tok/s", "step ms", "roofline ms",
               "x roof", "e2e tok/s", "HF tok/s", "x HF"]  # fmt: skip
    title = "engine through the scheduler (decode step vs roofline at the mean context)"
    return title + "\n" + format_table(headers, rows)


def steps_table(results: dict) -> str:
    rows = []
    for name, cfg in _configs(results).items():
        for key, row in _ok(cfg.get("decode_step")).items():
            rows.append([name, f"decode {key} @{row['context']}", row["step_ms"],
                         row.get("roofline_ms"), row.get("x_roofline"),
                         row["graph_replays"]])  # fmt: skip
        pre = _ok(cfg.get("prefill_step"))
        if pre:
            rows.append([name, f"prefill {pre['tokens']} tokens", pre["step_ms"],
                         pre.get("roofline_ms"), pre.get("x_roofline"), None])  # fmt: skip
    headers = ["config", "step", "ms", "roofline ms", "x roof", "graph replays"]
    return "engine, bare steps (runner.forward)\n" + format_table(headers, rows)


def shared_prefix_text(results: dict) -> str:
    sp = _ok(results.get("shared_prefix"))
    if not sp:
        return "shared prefix: -"
    rows = [[name, sp[name]["wall_s"], sp[name]["prefill_tokens_computed"],
             sp[name]["hit_rate"], sp[name]["output_tok_s"]]
            for name in ("radix", "none")]  # fmt: skip
    table = format_table(["cache", "wall s", "prefill tokens", "hit rate", "out tok/s"], rows)
    return (f"shared prefix, small preset ({sp['workload']})\n{table}\n"
            f"radix speed-up {sp['speedup']:.2f}x; hit rate {sp['radix']['hit_rate_of_max']:.0%} "
            f"of the max {sp['max_hit_rate']:.3f}; same outputs: {sp['same_outputs']}")  # fmt: skip


def problems_text(results: dict) -> str:
    lines = [f"  {path}: {problem}" for path, problem in _problems(results, "")]
    return "skipped or failed:\n" + "\n".join(lines) if lines else "nothing skipped or failed"


def _problems(node: Any, path: str):
    """(dotted path, reason) of every skipped or failed part, however deep."""
    if _problem(node):
        yield path.lstrip("."), _problem(node)
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _problems(value, f"{path}.{key}")


# ---- targets -----------------------------------------------------------------------------


def targets(results: dict) -> list[Target]:
    out = _kernel_targets(results)
    configs = _configs(results)
    for name, cfg in configs.items():
        if cfg.get("graphs"):
            out += _decode_targets(name, cfg)
        elif name.endswith("+graphs"):  # asked for, not captured (CPU, or the backend has none)
            out.append(Target(f"decode steps, {name}", "no graphs", "-", None, DECODE_GOAL))
    for name, cfg in configs.items():
        pre = _ok(cfg.get("prefill_step"))
        if pre:
            out.append(Target(f"prefill {pre['tokens']} tok/step, {name}",
                              f"{pre['step_ms']:.1f} ms", _ms(pre.get("roofline_ms")),
                              pre.get("x_roofline"), PREFILL_GOAL))  # fmt: skip
    return out + _hf_targets(results, configs)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _kernel_targets(results: dict) -> list[Target]:
    kern = _ok(results.get("kernels"))
    copy = _ok(results.get("device")).get("copy_GBps")
    out = []
    for name in ("decode", "decode_graph", "flashinfer_decode"):
        if f"{name}_GBps" in kern:
            rate = kern[f"{name}_GBps"]
            out.append(Target(f"{name} attention kernel, {kern['shape']}", f"{rate:,.0f} GB/s",
                              "-" if not copy else f"{copy:,.0f} GB/s",
                              rate / copy if copy else None, KERNEL_GOAL))  # fmt: skip
    return out


def _decode_targets(name: str, cfg: dict) -> list[Target]:
    out = []
    steps = _ok(cfg.get("decode_step"))
    for key, row in _ok(cfg.get("scheduler")).items():
        if key in steps and not _problem(row):
            out.append(Target(f"decode step e2e {key} (scheduler), {name}",
                              f"{row['decode_step_ms']:.2f} ms", _ms(row.get("roofline_ms")),
                              row.get("x_roofline"), DECODE_GOAL))  # fmt: skip
    for key, row in steps.items():
        out.append(Target(f"decode step {key} @{row['context']} ctx (forward), {name}",
                          f"{row['step_ms']:.2f} ms", _ms(row.get("roofline_ms")),
                          row.get("x_roofline"), DECODE_GOAL))  # fmt: skip
    return out


def _hf_targets(results: dict, configs: dict[str, dict]) -> list[Target]:
    hf = _ok(results.get("transformers"))
    out = []
    for name, cfg in configs.items():
        for key, row in _ok(cfg.get("scheduler")).items():
            hf_rate = hf.get(f"{key}_tok_s")
            if isinstance(hf_rate, float) and not _problem(row):
                out.append(Target(f"engine vs HF generate {key}, {name}",
                                  f"{row['e2e_tok_s']:,.0f} tok/s", f"HF {hf_rate:,.0f} tok/s",
                                  row["e2e_tok_s"] / hf_rate, "report"))  # fmt: skip
    return out


def targets_table(results: dict) -> str:
    rows = [[t.name, t.measured, t.bound, t.ratio_text(), t.goal, t.status()]
            for t in targets(results)]  # fmt: skip
    headers = ["target", "measured", "roofline / peer", "ratio", "goal", "status"]
    return "=== targets ===\n" + format_table(headers, rows)


def summary_text(results: dict) -> str:
    env = results.get("env", {})
    head = f"=== summary: {env.get('device')}, torch {env.get('torch')}, {env.get('shapes')} ==="
    parts = [head, device_text(results), kernels_table(results), quant_table(results),
             model_kernels_table(results), scheduler_table(results), speculative_table(results),
             steps_table(results), shared_prefix_text(results), problems_text(results),
             targets_table(results)]  # fmt: skip
    return "\n\n".join(parts)


if __name__ == "__main__":  # python gpu_report.py OUT_DIR/gpu_check.json
    import json
    import sys
    from pathlib import Path

    print(summary_text(json.loads(Path(sys.argv[1]).read_text())))
