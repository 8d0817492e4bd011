"""`radixserve bench serve` (a running server at --url), `bench offline` (an in-process
Engine), `bench compare` (systems it starts itself, see compare.py) and `bench simulate` (the
scheduler with a cost model, see simulate.py). Options are generated from the dataclasses
below and in common.py (what every mode shares), one docstring each."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
from dataclasses import dataclass

from radixserve.cli_args import add_dataclass_args, field_names
from radixserve.config import CacheConfig, SchedulerConfig
from radixserve_bench.common import (
    add_common_args,
    build_workloads,
    common_args,
    finish,
    from_args,
    load_tokenizer,
    run_config,
)


@dataclass
class ServerTarget:
    """The server under test."""

    url: str = "http://127.0.0.1:30000"
    """Base URL of the server."""
    backend: str = "radixserve"
    """radixserve | sglang (native /generate) | openai (/v1/completions) | llama-cpp |
    llama-server (llama.cpp's own /completion)."""
    model: str | None = None
    """Model name for OpenAI-compatible servers (default: the first one /v1/models lists)."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer <key>`."""
    page_size: int | None = None
    """Cache page size for the theoretical hit rate (default: the server's, else 16)."""
    tokenizer: str | None = None
    """Tokenizer folder for building prompts (default: the default model's, SmolLM2)."""


@dataclass
class EngineTarget:
    """The in-process engine under test."""

    model: str | None = None
    """HF folder, .gguf file or built-in config name; default: SmolLM2."""
    load_format: str = "auto"
    """auto | safetensors | gguf | dummy."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16."""
    device: str = "auto"
    """auto | cpu | cuda."""


def build_parser() -> argparse.ArgumentParser:
    """The `radixserve bench` parser, one subcommand per mode."""
    about = "Benchmark serving workloads; `radixserve bench MODE -h` lists a mode's options."
    parser = argparse.ArgumentParser(prog="radixserve bench", description=about)
    modes = parser.add_subparsers(dest="bench_command", required=True)
    serve = modes.add_parser("serve", help="benchmark a running server at --url")
    add_dataclass_args(serve, ServerTarget, "server")
    add_common_args(serve)
    offline = modes.add_parser("offline", help="benchmark radixserve.Engine in-process")
    add_dataclass_args(offline, EngineTarget, "model")
    add_dataclass_args(offline, CacheConfig, "KV cache")
    add_dataclass_args(offline, SchedulerConfig, "scheduler")
    add_common_args(offline)
    from radixserve_bench.compare import add_compare_parser
    from radixserve_bench.retention_bench import add_retention_parser
    from radixserve_bench.simulate_cli import add_simulate_parser

    add_compare_parser(modes)
    add_simulate_parser(modes)
    add_retention_parser(modes)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `radixserve bench ...`; `argv` is what follows `bench`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return run_bench(args)


def run_bench(args: argparse.Namespace) -> int:
    """Runs the parsed mode."""
    if args.bench_command == "serve":
        return run_serve_bench(args)
    if args.bench_command == "compare":
        from radixserve_bench.compare import run_compare_bench

        return run_compare_bench(args)
    if args.bench_command == "simulate":
        from radixserve_bench.simulate_cli import run_simulate_bench

        return run_simulate_bench(args)
    if args.bench_command == "retention":
        from radixserve_bench.retention_bench import run_retention_bench

        return run_retention_bench(args)
    return run_offline_bench(args)


def run_serve_bench(args: argparse.Namespace) -> int:
    from radixserve_bench.backends import BACKENDS, make_backend
    from radixserve_bench.client import run_online

    spec, load, report = common_args(args)
    target = from_args(ServerTarget, args)
    if target.backend not in BACKENDS:
        choices = ", ".join(BACKENDS)
        raise SystemExit(f"radixserve bench: unknown backend {target.backend!r}; use {choices}")
    tokenizer = load_tokenizer(target.tokenizer)
    workload, warmup = build_workloads(spec, tokenizer, load.num_warmup)
    backend = make_backend(target.backend, target.url, tokenizer, target.model, target.api_key)
    run = asyncio.run(
        run_online(workload, backend, load, spec.seed, warmup, target.page_size, report.system,
                   report.progress)
    )  # fmt: skip
    target_info = dataclasses.asdict(target) | {"api_key": None}
    return finish([run], report, run_config("serve", workload, load, target_info))


def run_offline_bench(args: argparse.Namespace) -> int:
    from radixserve.client.engine import Engine
    from radixserve_bench.offline import run_offline

    spec, load, report = common_args(args)
    if not math.isinf(load.request_rate):
        raise SystemExit("radixserve bench offline: use --max-concurrency, not --request-rate")
    engine_args = {
        name: getattr(args, name)
        for cls in (EngineTarget, CacheConfig, SchedulerConfig)
        for name in field_names(cls)
    }
    engine = Engine(**engine_args)
    try:
        workload, warmup = build_workloads(spec, engine.tokenizer, load.num_warmup)
        system = report.system or "offline"
        run = run_offline(engine, workload, load.max_concurrency, warmup, system, report.progress)
    finally:
        engine.shutdown()
    return finish([run], report, run_config("offline", workload, load, engine_args))
