"""Latency of a request through Anthropic's /v1/messages and OpenAI's /v1/responses vs
/v1/chat/completions.

The same conversation (one user turn), the same `max_tokens`, greedy, `ignore_eos` so all
generate exactly that many tokens; plain and streamed (time to the last byte). Rounds are
interleaved and rotate which API goes first, so drift on a shared machine hits all alike;
each API's median over `--rounds` is reported with its overhead over chat completions in %.
All prompts render through the same chat template, so all are served from the radix cache
after the warm-up: the difference is the API layer (Responses stores every response, as its
`store` default is).

On a busy machine the end-to-end medians swing by more than the layer costs, so the script
also times, in process and in thread CPU time, what differs between the two paths before
the engine sees a request: checking the body, rendering the chat template, tokenizing
(`--layer-rounds` interleaved batches of 50, medians); each difference over the chat
completions end-to-end median is the overhead a quiet machine would show.

Run:  python benchmarks/messages_overhead.py [--model PATH] [--tokens 32 --rounds 9]
      python benchmarks/messages_overhead.py --url http://127.0.0.1:30000  (a running server)
Prints a table; writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

from radixserve.native.machine import describe_cpu
from radixserve_bench.systems import ManagedServer, free_port

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
APIS = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--url", default=None, help="use this running server instead of starting one")
    p.add_argument("--tokens", type=int, default=32, help="max_tokens of every request")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (>= 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layer-rounds", type=int, default=15, help="in-process timing batches")
    p.add_argument("--out", type=Path, default=Path("bench_results/messages_overhead.json"))
    args = p.parse_args()
    if args.rounds < 5:
        p.error("--rounds must be at least 5 (medians of at least 5)")
    return args


def request_body(api: str, model: str, tokens: int, stream: bool) -> tuple[str, dict]:
    """The path and body of one request: the same conversation and sampling for every API."""
    body = {"model": model, "temperature": 0, "ignore_eos": True, "stream": stream}
    if api == "responses":
        body |= {"input": [{"role": "user", "content": PROMPT}], "max_output_tokens": tokens}
    else:
        body |= {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens}
    return PATHS[api], body


def timed_request(conn: http.client.HTTPConnection, path: str, body: dict) -> float:
    """Seconds from sending the request to its last byte (keep-alive connection)."""
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    conn.request("POST", path, payload, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    elapsed = time.perf_counter() - start
    if response.status != 200:
        raise RuntimeError(f"{path} answered {response.status}: {data[:300]!r}")
    return elapsed


def measure(url: str, model: str, args: argparse.Namespace, stream: bool) -> dict[str, list]:
    """Per-API latencies over interleaved rounds, each round's order rotated by one."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    bodies = {api: request_body(api, model, args.tokens, stream) for api in APIS}
    for _ in range(args.warmup):
        for api in APIS:
            timed_request(conn, *bodies[api])
    times: dict[str, list] = {api: [] for api in APIS}
    for round_index in range(args.rounds):
        shift = round_index % len(APIS)
        order = APIS[shift:] + APIS[:shift]
        for api in order:
            times[api].append(timed_request(conn, *bodies[api]))
    conn.close()
    return times


def served_model(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def report(results: dict[str, dict[str, list]]) -> list[dict]:
    """One row per mode: each API's median, and the others' overhead over chat in %."""
    rows = []
    others = APIS[1:]
    head = "".join(f" {api + ' ms':>13}" for api in APIS)
    print(f"{'mode':<8}{head}" + "".join(f" {api + ' +%':>12}" for api in others))
    for mode, times in results.items():
        medians = {api: statistics.median(times[api]) for api in APIS}
        overhead = {api: (medians[api] / medians["chat"] - 1) * 100 for api in others}
        cells = "".join(f" {medians[api] * 1e3:>13.1f}" for api in APIS)
        print(f"{mode:<8}{cells}" + "".join(f" {overhead[api]:>11.2f}%" for api in others))
        row = {"mode": mode, "times": times, "overhead_pct": overhead}
        rows.append(row | {f"{api}_median_s": medians[api] for api in APIS})
    return rows


def layer_costs(tokens: int, rounds: int, batch: int = 50) -> dict[str, float]:
    """Thread CPU seconds per request of each API's body check + template + tokenization."""
    from radixserve.model.tokenizer import open_tokenizer
    from radixserve.server.anthropic_api import render_prompt
    from radixserve.server.anthropic_protocol import parse_messages_request
    from radixserve.server.openai_api import prompt_ids
    from radixserve.server.openai_protocol import parse_request
    from radixserve.server.responses_api import render_prompt as render_responses
    from radixserve.server.responses_protocol import parse_responses_request
    from radixserve.server.tool_parsers import DEFAULT_TOOL_PARSER

    tokenizer = open_tokenizer(None, 49152, "default")
    state = SimpleNamespace(tokenizer=tokenizer, tool_parser=DEFAULT_TOOL_PARSER)
    bodies = {api: request_body(api, "m", tokens, False)[1] for api in APIS}
    paths = {
        "chat": lambda: prompt_ids(state, parse_request(bodies["chat"], chat=True)),
        "messages": lambda: render_prompt(state, parse_messages_request(bodies["messages"]), True),
        "responses": lambda: render_responses(
            state, parse_responses_request(bodies["responses"]), []
        ),
    }
    times: dict[str, list[float]] = {api: [] for api in APIS}
    for _ in range(rounds):
        for api in APIS:
            start = time.thread_time()
            for _ in range(batch):
                paths[api]()
            times[api].append((time.thread_time() - start) / batch)
    return {api: statistics.median(values) for api, values in times.items()}


def run(url: str, args: argparse.Namespace) -> list[dict]:
    model = served_model(url)
    results = {mode: measure(url, model, args, mode == "stream") for mode in ("plain", "stream")}
    rows = report(results)
    layer = layer_costs(args.tokens, args.layer_rounds)
    chat_e2e = rows[0]["chat_median_s"]
    extra = {api: (layer[api] - layer["chat"]) / chat_e2e * 100 for api in APIS[1:]}
    costs = ", ".join(f"{api} {layer[api] * 1e3:.3f}" for api in APIS)
    differences = ", ".join(f"{api} {pct:+.4f}%" for api, pct in extra.items())
    print(f"layer (CPU ms/request): {costs}; over the chat median: {differences}")
    rows.append({"mode": "layer", "cpu_s_per_request": layer, "overhead_pct_of_chat_median": extra})
    return rows


def main() -> None:
    args = parse_args()
    print(f"machine: {describe_cpu()}; {args.tokens} tokens, {args.rounds} rounds")
    if args.url:
        rows = run(args.url, args)
    else:
        port = free_port()
        model = [args.model] if args.model else []
        command = [sys.executable, "-m", "radixserve.cli", "serve", *model, "--port", str(port)]
        log = args.out.with_suffix(".log")
        with ManagedServer(command, "/health", log, port) as server:
            server.start(timeout=300)
            rows = run(server.url, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"machine": describe_cpu(), "tokens": args.tokens, "rounds": args.rounds}
    args.out.write_text(json.dumps(summary | {"results": rows}, indent=2))


if __name__ == "__main__":
    main()
