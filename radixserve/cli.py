"""`radixserve` command line: `generate` (offline batch), `serve` (HTTP server), `fleet`
(workers behind sglang-router), `train-eagle` (an EAGLE-3 draft head), `bench` (the
benchmarks, a separate package)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from radixserve.cli_args import add_dataclass_args, field_names
from radixserve.config import (
    CacheConfig,
    DisaggregationConfig,
    FleetConfig,
    HiCacheConfig,
    LoadConfig,
    LoraConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    TrainEagleConfig,
    resolve_keys,
)
from radixserve.config.server import LOG_LEVELS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts, in one offline batch")
    gen.add_argument("prompts", nargs="+", help="prompt texts; all run in one batch")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="(default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="(default: random)")
    gen.add_argument("--log-level", default="warning", help="(default: warning)")
    gen.add_argument("--lora-path", default=None, help="run the prompts with this LoRA adapter "
                     "(a name from --lora-paths; default: the base model)")  # fmt: skip
    add_dataclass_args(gen, LoadConfig, "model")
    gen.add_argument("--model-path", dest="model", help="alias of --model")
    add_dataclass_args(gen, CacheConfig, "KV cache")
    add_dataclass_args(gen, SchedulerConfig, "scheduler")
    add_dataclass_args(gen, HiCacheConfig, "hierarchical cache")
    add_dataclass_args(gen, ParallelConfig, "parallelism")
    add_dataclass_args(gen, LoraConfig, "LoRA adapters")
    srv = sub.add_parser("serve", help="serve the native and OpenAI-compatible HTTP APIs")
    add_server_args(srv)
    add_dataclass_args(srv, ParallelConfig, "parallelism")
    add_dataclass_args(srv, DisaggregationConfig, "prefill/decode disaggregation")
    fleet = sub.add_parser(
        "fleet",
        help="serve N data-parallel workers, or P prefill + D decode workers, behind "
        "sglang-router (extra: [fleet])",
    )
    add_dataclass_args(fleet, FleetConfig, "fleet")
    # workers' ports: --worker-base-port; the fleet registers its workers with its own router
    add_server_args(fleet, exclude=("port", "router_url", "advertise_url"))
    pd_title = "prefill/decode disaggregation (with --prefill-workers / --decode-workers)"
    add_dataclass_args(fleet, DisaggregationConfig, pd_title, exclude=("disaggregation_mode",))
    train = sub.add_parser(
        "train-eagle",
        help="train an EAGLE-3 draft head on the model's own answers (training-time test)",
    )
    train.add_argument("--log-level", default="info", help="(default: info)")
    add_train_args(train)
    # listed for --help only: main hands everything after `bench` to radixserve_bench
    sub.add_parser("bench", add_help=False, help="benchmark serving workloads (see `bench -h`)")
    return parser


def add_server_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """The options of `serve` (all but `exclude` of the server's): model, server, cache,
    scheduler."""
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="model (default: SmolLM2)")
    add_dataclass_args(parser, ServerConfig, "server", exclude)
    add_dataclass_args(parser, LoadConfig, "model")
    parser.add_argument("--model-path", dest="model", help="alias of --model")
    add_dataclass_args(parser, CacheConfig, "KV cache")
    add_dataclass_args(parser, SchedulerConfig, "scheduler")
    add_dataclass_args(parser, HiCacheConfig, "hierarchical cache")
    add_dataclass_args(parser, LoraConfig, "LoRA adapters")


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """`train-eagle`: the model (its seed is the training's), the KV cache, the training."""
    add_dataclass_args(parser, LoadConfig, "model", exclude=("seed",))
    parser.add_argument("--model-path", dest="model", help="alias of --model")
    add_dataclass_args(parser, CacheConfig, "KV cache")
    add_dataclass_args(parser, TrainEagleConfig, "training")


def engine_args_from(args: argparse.Namespace) -> dict:
    if getattr(args, "model_arg", None) is not None:  # `serve MODEL` / `fleet MODEL`
        args.model = args.model_arg
    groups = (LoadConfig, CacheConfig, SchedulerConfig, ParallelConfig, DisaggregationConfig)
    groups += (HiCacheConfig, LoraConfig)
    return {  # `fleet` has no ParallelConfig flags: its workers are one process each
        name: getattr(args, name)
        for cls in groups
        for name in field_names(cls)
        if hasattr(args, name)
    }


def run_serve(args: argparse.Namespace) -> int:
    from radixserve.client.core_start import set_openmp_defaults

    set_openmp_defaults()  # before torch loads, so that the engine core can fork
    from radixserve.engine.preflight import verify_engine_args
    from radixserve.model.source import ModelLoadError
    from radixserve.server.launch import serve

    engine_args = engine_args_from(args)
    try:
        server = resolve_keys(server_config_from(args))
        verify_engine_args(None, engine_args)  # here, not as a traceback of the core's process
    except (TypeError, ValueError, ModelLoadError) as exc:
        raise SystemExit(f"radixserve serve: {exc}") from None
    return serve(engine_args, server)


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    names = [name for name in field_names(ServerConfig) if hasattr(args, name)]
    config = ServerConfig(**{name: getattr(args, name) for name in names})
    try:
        config.verify()
    except ValueError as exc:
        raise SystemExit(f"radixserve: {exc}") from None
    return config


def run_fleet(args: argparse.Namespace) -> int:
    from radixserve.engine.preflight import verify_engine_args
    from radixserve.fleet.launch import run_fleet as launch_fleet
    from radixserve.fleet.router import RouterNotInstalledError
    from radixserve.model.source import ModelLoadError
    from radixserve.server.launch import check_server_names

    engine_args = engine_args_from(args)
    try:
        server = resolve_keys(server_config_from(args))
        config = FleetConfig(**{name: getattr(args, name) for name in field_names(FleetConfig)})
        check_server_names(server)  # the workers' and router's flags, before any starts
        verify_engine_args(None, engine_args)
    except (TypeError, ValueError, ModelLoadError) as exc:
        raise SystemExit(f"radixserve fleet: {exc}") from None
    try:
        return launch_fleet(config, server, engine_args)
    except (RouterNotInstalledError, ValueError) as exc:
        raise SystemExit(f"radixserve fleet: {exc}") from None


def run_generate(args: argparse.Namespace) -> int:
    from radixserve.client.engine import Engine
    from radixserve.model.source import ModelLoadError
    from radixserve.model.tokenizer import chat_prompt_text
    from radixserve.sampling.params import SamplingParams

    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "sampling_seed": args.sampling_seed,
    }
    start = time.perf_counter()
    try:  # the sampling flags and --lora-path too, though they are read after the load
        SamplingParams.from_dict(params).verify()
        check_lora_path(args.lora_path, args.lora_paths)
        engine = Engine(**engine_args_from(args))
    except (TypeError, ValueError, ModelLoadError) as exc:  # a flag refused, a model not found
        raise SystemExit(f"radixserve generate: {exc}") from None
    loaded_s = time.perf_counter() - start
    prompts = args.prompts
    if args.chat:
        prompts = [chat_prompt_text(engine.tokenizer, p) for p in prompts]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, lora_path=args.lora_path)
    gen_s = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs):
        print(f"### {prompt}\n{out['text']}\n")
    stats = engine.get_stats()
    num_out = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    print(
        f"[{engine.model_name} on {engine.runner.device}] loaded in {loaded_s:.1f}s; "
        f"{stats['prompt_tokens']} prompt tokens ({stats['cached_tokens']} from cache) + "
        f"{num_out} generated in {gen_s:.2f}s ({num_out / gen_s:.1f} tok/s)",
        file=sys.stderr,
    )
    engine.shutdown()
    return 0


def check_lora_path(name: str | None, lora_paths: list[str] | None) -> None:
    """`generate --lora-path NAME`: NAME must be one of the adapters --lora-paths loads."""
    if name is None:
        return
    names = LoraConfig(lora_paths=lora_paths).adapter_paths()
    if name not in names:
        served = ", ".join(names) or "none"
        raise ValueError(f"--lora-path {name!r} is not an adapter of --lora-paths ({served})")


def run_train_eagle(args: argparse.Namespace) -> int:
    from radixserve.train.eagle3_trainer import train_eagle3

    config = TrainEagleConfig(**{n: getattr(args, n) for n in field_names(TrainEagleConfig)})
    try:
        record = train_eagle3(config, engine_args_from(args))
    except ValueError as exc:
        raise SystemExit(f"radixserve train-eagle: {exc}") from None
    last = record["epoch_losses"][-1] if record["epoch_losses"] else {}
    print(
        f"wrote {config.output}: {record['num_sequences']} answers, "
        f"{record['response_tokens']} tokens (sha256 {record['data_sha256'][:16]}), "
        f"last epoch {last}, {record['cpu_seconds']['total']} CPU s",
        file=sys.stderr,
    )
    return 0


def verify_parallel(args: argparse.Namespace) -> None:
    """Bad parallelism flags (--nnodes, --node-rank, ...) end the command before any load."""
    config = ParallelConfig(**{name: getattr(args, name) for name in field_names(ParallelConfig)})
    try:
        config.verify()
    except ValueError as exc:
        raise SystemExit(f"radixserve {args.command}: {exc}") from None


def run_node(args: argparse.Namespace) -> int:
    """`serve --nnodes N --node-rank R` (R > 0): this machine's ranks, joined to node 0."""
    from radixserve.distributed.group import RankFailedError
    from radixserve.model.tp_node import serve_node

    try:
        return serve_node(engine_args_from(args), args.log_level)
    except (RankFailedError, ValueError) as exc:
        raise SystemExit(f"radixserve {args.command} --node-rank {args.node_rank}: {exc}") from None


def run_bench(argv: list[str]) -> int:
    """`radixserve bench ...`: the bench is a tool beside the runtime, imported only here."""
    try:
        from radixserve_bench.cli import main as bench_main
    except ModuleNotFoundError as exc:
        if exc.name != "radixserve_bench":
            raise
        # an editable install made before the bench moved out maps only `radixserve`
        message = "radixserve bench: radixserve_bench is not installed; run `pip install -e .`"
        raise SystemExit(f"{message} (or scripts/install.sh) again") from None
    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the only top-level option is -h, so the command comes first
        return run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level.lower() not in LOG_LEVELS:
        allowed = " | ".join(LOG_LEVELS)
        parser.error(f"argument --log-level: must be {allowed}; got {args.log_level!r}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if hasattr(args, "node_rank"):
        verify_parallel(args)
        if args.node_rank != 0:  # a node of multi-node TP: its ranks, no HTTP
            return run_node(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "fleet":
        return run_fleet(args)
    if args.command == "train-eagle":
        return run_train_eagle(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
