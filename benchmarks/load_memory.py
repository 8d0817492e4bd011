"""Load time and memory of a GGUF at size: Engine start to ready, resident memory against the
file size plus the KV pool, and single-stream decode speed.

Each model loads in a fresh child process (so peak RSS is its own): the seconds from
`Engine(...)` to ready (wall and the process's CPU time), /proc/self/status's VmRSS (now),
VmHWM (peak), RssAnon (anonymous: copies, activations, the KV pages written so far) and RssFile
(file-backed: the mapped GGUF's pages, the libraries), all after the load and again after a
decode of `--decode-tokens` tokens; then the pool's size and `rss / (file + pool)`. The pool is
sized by the engine (40% of available memory after the weights) unless --cpu-kv-cache-gb or
--max-total-tokens is given; its pages count only once written. `--repeats` loads each model
that many times in turn (the first may build the C++ extension and fill the page cache).

Run:  python benchmarks/load_memory.py ~/.cache/radixserve/realistic-gguf/llama-3.2-1b-Q4_K_M.gguf
      (any .gguf paths; another tree's code: PYTHONPATH=<tree> python <this file> ...)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GiB = 1 << 30
STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", type=Path, help=".gguf files")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cpu-kv-cache-gb", type=float, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--cpu-quant-activation", default=None, help="fp32 skips auto's probe")
    p.add_argument("--out", type=Path, default=Path("bench_results/load_memory.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def status_bytes() -> dict[str, int]:
    """/proc/self/status's memory fields, in bytes."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in STATUS_FIELDS:
            values[key] = int(rest.split()[0]) * 1024
    return values


def measure(model: Path, args: argparse.Namespace) -> dict:
    """One load and decode in this process."""
    from radixserve import Engine

    options: dict = {}
    if args.cpu_kv_cache_gb is not None:
        options["cpu_kv_cache_gb"] = args.cpu_kv_cache_gb
    if args.max_total_tokens is not None:
        options["max_total_tokens"] = args.max_total_tokens
    if args.cpu_quant_activation is not None:
        options["cpu_quant_activation"] = args.cpu_quant_activation
    wall, cpu = time.perf_counter(), time.process_time()
    engine = Engine(model_path=str(model), **options)
    load_s, load_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    loaded = status_bytes()
    pool = engine.runner.pool
    pool_bytes = pool.k.nbytes + pool.v.nbytes
    prompt = [(7 * i + 100) % 1000 + 100 for i in range(args.prompt_tokens)]
    params = {"temperature": 0, "max_new_tokens": args.decode_tokens, "ignore_eos": True}
    engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 2})  # warm-up
    wall = time.perf_counter()
    out = engine.generate(input_ids=prompt, sampling_params=params)
    decode_s = time.perf_counter() - wall
    tokens = out["meta_info"]["completion_tokens"]
    after = status_bytes()
    engine.shutdown()
    file_bytes = model.stat().st_size
    return {
        "model": str(model),
        "file_bytes": file_bytes,
        "kv_pool_bytes": pool_bytes,
        "kv_pool_tokens": pool.capacity_tokens,
        "load_s": load_s,
        "load_cpu_s": load_cpu_s,
        "loaded": loaded,
        "after_decode": after,
        "decode_tokens": tokens,
        "decode_tok_s": tokens / decode_s,
        "peak_over_file_plus_pool": after["VmHWM"] / (file_bytes + pool_bytes),
        "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count(),
    }


def run_child(model: Path, args: argparse.Namespace, argv: list[str]) -> dict:
    command = [sys.executable, __file__, str(model), "--child", *argv]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model}: child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--decode-tokens", str(args.decode_tokens), "--prompt-tokens", str(args.prompt_tokens)]
    if args.cpu_kv_cache_gb is not None:
        argv += ["--cpu-kv-cache-gb", str(args.cpu_kv_cache_gb)]
    if args.max_total_tokens is not None:
        argv += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.cpu_quant_activation is not None:
        argv += ["--cpu-quant-activation", args.cpu_quant_activation]
    return argv


def print_table(rows: list[dict], cpu: str) -> None:
    print(f"CPU: {cpu}")
    header = (
        f"{'model':34} {'file GiB':>8} {'pool GiB':>8} {'load s':>7} {'cpu s':>6} "
        f"{'RSS':>6} {'peak':>6} {'anon':>6} {'file-b':>6} {'peak/(file+pool)':>16} {'tok/s':>6}"
    )
    print(header)
    for r in rows:
        a = r["after_decode"]
        print(
            f"{Path(r['model']).name[:34]:34} {r['file_bytes'] / GiB:8.2f} "
            f"{r['kv_pool_bytes'] / GiB:8.2f} {r['load_s']:7.2f} {r['load_cpu_s']:6.2f} "
            f"{a['VmRSS'] / GiB:6.2f} {a['VmHWM'] / GiB:6.2f} {a['RssAnon'] / GiB:6.2f} "
            f"{a['RssFile'] / GiB:6.2f} {r['peak_over_file_plus_pool']:16.2f} "
            f"{r['decode_tok_s']:6.1f}"
        )
    print("memory columns in GiB after the decode (RSS, peak = VmHWM, anon = RssAnon, file-b =")
    print("RssFile); the `loaded` entries of the JSON hold the same right after the load")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.models[0], args)))
        return
    from radixserve.native.machine import describe_cpu

    rows = [
        run_child(model.expanduser(), args, child_argv(args))
        for _ in range(args.repeats)
        for model in args.models
    ]
    cpu = describe_cpu()
    print_table(rows, cpu)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu, "runs": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
