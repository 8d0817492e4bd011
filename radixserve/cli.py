"""`radixserve` command line: `generate` (serve, chat and bench arrive with their issues)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from radixserve.cli_args import add_dataclass_args, dataclass_from_args
from radixserve.config import CacheConfig, LoadConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy-generate completions for prompts, in one batch")
    gen.add_argument("prompts", nargs="+", help="prompt texts; all run in one batch")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="(default: 64)")
    gen.add_argument("--log-level", default="warning", help="(default: warning)")
    add_dataclass_args(gen, LoadConfig, "model")
    gen.add_argument("--model-path", dest="model", help="alias of --model")
    add_dataclass_args(gen, CacheConfig, "KV cache")
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from radixserve.engine.greedy import greedy_generate
    from radixserve.model.loader import load_model
    from radixserve.model.runner import ModelRunner
    from radixserve.model.tokenizer import chat_prompt_ids, load_tokenizer

    load_config = dataclass_from_args(LoadConfig, args)
    cache_config = dataclass_from_args(CacheConfig, args)
    start = time.perf_counter()
    loaded = load_model(load_config)
    runner = ModelRunner.from_loaded(loaded, load_config, cache_config)
    tokenizer = load_tokenizer(loaded)
    loaded_s = time.perf_counter() - start
    if args.chat:
        prompts = [chat_prompt_ids(tokenizer, p) for p in args.prompts]
    else:
        prompts = [tokenizer.encode(p) for p in args.prompts]
    stop_ids = set(loaded.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    start = time.perf_counter()
    outputs = greedy_generate(runner, prompts, args.max_new_tokens, sorted(stop_ids))
    gen_s = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs):
        print(f"### {prompt}\n{tokenizer.decode(out, skip_special_tokens=True)}\n")
    num_prompt = sum(map(len, prompts))
    num_out = sum(map(len, outputs))
    print(
        f"[{loaded.name} on {runner.device}, page_size {runner.pool.page_size}] "
        f"loaded in {loaded_s:.1f}s; {num_prompt} prompt + {num_out} generated tokens "
        f"in {gen_s:.2f}s ({num_out / gen_s:.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return run_generate(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
