"""One decode step's CPU time in two (or more) checkouts of radixserve, their passes alternated.

`decode_step_profile.py` alternates engines inside one process, which compares settings of
one build; a change to the C++ kernels or to the model's Python needs each checkout's own
code and extension. Here each checkout gets a worker process (this file with `--worker`,
PYTHONPATH set to the checkout, importing that checkout's `decode_step_profile.py`) that
builds its engine, decodes `--batch` requests of `--context` tokens until they all decode,
and then runs `--steps` timed decode steps each time the driver asks; the driver asks the
workers in turn, `--rounds` times, so a loaded machine slows them alike. Per pass: thread
CPU ms per `scheduler.step()` and per model forward (median of the pass's steps); printed:
the median over the rounds, and each checkout's step over the first's.

`--stub-kernels` replaces the GGUF block matmuls and the paged decode attention with
stand-ins that only allocate their outputs: what is left is the step around its kernels
(the Python forward, the small ops, the scheduler), which the weights' streaming time, the
noisiest part of a step on a shared machine, would otherwise hide.

Run:  OMP_NUM_THREADS=1 python benchmarks/decode_step_checkouts.py --checkouts /path/a,/path/b \
          --model model.gguf --quantization auto
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkouts", required=True, help="comma-separated repository roots")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per pass")
    p.add_argument("--rounds", type=int, default=5, help="passes per checkout, alternated")
    stub = "block matmuls and decode attention only allocate their outputs"
    p.add_argument("--stub-kernels", action="store_true", help=stub)
    p.add_argument("--out", type=Path, default=Path("bench_results/decode_step_checkouts.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """Builds this checkout's engine, then answers each `run` line on stdin with one pass."""
    import torch

    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    import decode_step_profile as profile

    torch.set_num_threads(1)
    opts = profile.parse_args(["--context", str(args.context), "--steps", str(args.steps),
                               "--rounds", str(args.rounds)])  # fmt: skip
    opts.model = args.model
    core = profile.build_core(opts, args.batch, False, "auto", "auto", "auto", args.quantization)
    profile.add_requests(core, args.batch, opts)
    with torch.inference_mode():
        profile.until_all_decode(core)
        if args.stub_kernels:
            stub_kernels(core)
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "run":
                break
            print(json.dumps(profile.plain_pass(core, args.steps)), flush=True)
    core.close()


def stub_kernels(core) -> None:
    """The block matmuls (their Python entry points, looked up at each call) and the decode
    attention kernel -> stand-ins returning uninitialized outputs of the right shape."""
    import torch

    from radixserve.model.quant import block_matmul, kquant, q8_matmul

    def matmul(x, weight, *args):  # [M, K], [N, ...] -> [M, N]
        return torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)

    for module, names in ((block_matmul, ("int4_block_matmul", "int8_block_matmul")),
                          (q8_matmul, ("int4_block_matmul_q8", "int8_block_matmul_q8",
                                       "kquant_matmul_q8")),
                          (kquant, ("kquant_matmul",))):  # fmt: skip
        for name in names:
            setattr(module, name, matmul)
    core.scheduler.runner.attn._paged_decode = lambda q, *args: torch.empty(q.shape)


def start_worker(checkout: str, argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=checkout)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", *argv]
    proc = subprocess.Popen(command, cwd=checkout, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise RuntimeError(f"the worker of {checkout} exited before it was ready")


def one_pass(proc: subprocess.Popen) -> dict[str, float]:
    proc.stdin.write("run\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("a worker exited during its pass")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    checkouts = args.checkouts.split(",")
    forwarded = ["--checkouts", args.checkouts, "--quantization", args.quantization]
    forwarded += ["--stub-kernels"] if args.stub_kernels else []
    for flag in ("batch", "context", "steps", "rounds"):
        forwarded += [f"--{flag}", str(getattr(args, flag))]
    if args.model is not None:
        forwarded += ["--model", args.model]
    procs = {c: start_worker(c, forwarded) for c in checkouts}
    passes: dict[str, list[dict[str, float]]] = {c: [] for c in checkouts}
    try:
        for _ in range(args.rounds):
            for checkout, proc in procs.items():
                passes[checkout].append(one_pass(proc))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    rows = []
    for checkout, runs in passes.items():
        row = {"checkout": checkout}
        row |= {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row["step_per_pass"] = [r["step"] for r in runs]
        rows.append(row)
    first = rows[0]["step"]
    print(f"{'checkout':>40}{'step ms':>10}{'forward':>10}{'build':>8}{'sample':>8}{'x first':>9}")
    for row in rows:
        cells = f"{row['step']:>10.2f}{row['forward']:>10.2f}{row['build_batch']:>8.2f}"
        print(f"{row['checkout']:>40}{cells}{row['sample']:>8.2f}{first / row['step']:>9.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k not in ("out", "worker")}
    args.out.write_text(json.dumps({**meta, "clock": "thread CPU time", "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
