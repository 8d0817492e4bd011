"""Soak test: mixed requests against a real `radixserve serve` with a tiny KV pool.

The pool (SERVER_FLAGS) forces eviction and retraction; afterwards the server's page
accounting must check out.

The mix (soak_mix.py): native /generate and OpenAI completions and chat, streamed or not;
streams the client hangs up on, streams aborted through /abort_request; constrained output,
n > 1, logprobs, shared prefixes, long prompts, bursts of long outputs. With faults on, the
server runs with RADIXSERVE_FAULTS and a few native requests carry a `fault-` rid: those
must end in an abort, every other request normally (or cut short, on purpose, by us).

Checks: every request answered (no client error or timeout), no 5xx, each request ended as
planned, the server idle afterwards, GET /check_integrity ok, POST /flush_cache ok and then
every page free, /health 200. Prints a table, writes JSON, exits 1 if a check fails.

Run:  python benchmarks/soak.py --requests 1000 [--model PATH | --url URL] [--out soak.json]
Without --url it serves a tiny random Llama built on the spot (SmolLM2's tokenizer borrowed)
or --model, with SERVER_FLAGS and faults on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from soak_mix import FAULT_PREFIX, Plan, plan_requests

from radixserve.engine.faults import ENV_VAR as FAULTS_ENV_VAR
from radixserve_bench.systems import ManagedServer, free_port

FAULTS = {"rid_prefix": FAULT_PREFIX, "points": ["commit", "sample"]}
SERVER_FLAGS = (
    "--max-total-tokens 1024 --page-size 16 --chunked-prefill-size 64 --max-running-requests 16"
).split()
"""A pool of 64 pages for 16 running requests of up to ~600 prompt tokens: evicts, retracts."""
NORMAL_FINISHES = {"length", "stop"}
SETTLE_S = 30.0  # for hung-up streams to be noticed and aborted before the final checks
SERVER_STATS = (
    "cache_hit_rate",
    "evicted_pages",
    "retractions",
    "num_requests",
    "prompt_tokens",
    "prefill_tokens_computed",
    "decode_tokens",
    "forward_steps",
)


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 300
    concurrency: int = 16
    seed: int = 0
    faults: bool = True
    """The server runs with FAULTS: send some native requests with a fault- rid."""
    fault_fraction: float = 0.1
    """Of the plain native requests."""
    request_timeout_s: float = 120.0
    api_key: str | None = None


@dataclass
class Outcome:
    plan: Plan
    status: int | None = None  # None: no answer (client error or timeout)
    finishes: dict[int, str] = field(default_factory=dict)  # choice index -> finish reason
    error: str | None = None


# ---- sending -----------------------------------------------------------------------------


async def send_all(url: str, plans: list[Plan], config: SoakConfig) -> list[Outcome]:
    limit = asyncio.Semaphore(config.concurrency)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None

    async def one(session: aiohttp.ClientSession, plan: Plan) -> Outcome:
        async with limit:
            return await send(session, url, plan, config.request_timeout_s)

    connector = aiohttp.TCPConnector(limit=config.concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        return await asyncio.gather(*(one(session, plan) for plan in plans))


async def send(session: aiohttp.ClientSession, url: str, plan: Plan, timeout_s: float) -> Outcome:
    outcome = Outcome(plan)
    try:
        await asyncio.wait_for(_send(session, url, outcome), timeout_s)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def _send(session: aiohttp.ClientSession, url: str, outcome: Outcome) -> None:
    plan = outcome.plan
    async with session.post(url + plan.path, json=plan.body) as resp:
        outcome.status = resp.status
        if resp.status != 200:
            outcome.error = (await resp.text())[:300]
        elif plan.body.get("stream"):
            await _read_stream(session, url, resp, outcome)
        else:
            _record(outcome, await resp.json())


async def _read_stream(session, url: str, resp: aiohttp.ClientResponse, outcome: Outcome):
    """Reads the events to [DONE]. After the first chunk a hang_up closes the connection and
    an abort_request aborts its rid."""
    plan, num_chunks = outcome.plan, 0
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[len(b"data: ") :].strip()
        if payload == b"[DONE]":
            return
        _record(outcome, json.loads(payload))
        num_chunks += 1
        if num_chunks == 1 and plan.kind == "hang_up":
            resp.close()
            return
        if num_chunks == 1 and plan.kind == "abort_request":
            async with session.post(url + "/abort_request", json={"rid": plan.body["rid"]}) as r:
                if r.status != 200:
                    outcome.error = f"/abort_request answered {r.status}"
    outcome.error = outcome.error or "stream ended without [DONE]"


def _record(outcome: Outcome, payload: Any) -> None:
    """Notes the finish reasons an answer or a chunk carries, and any error event."""
    items = payload if isinstance(payload, list) else [payload]
    for position, item in enumerate(items):
        if "error" in item:
            outcome.error = f"error event: {item['error']}"
        for choice in item.get("choices", []):
            if choice.get("finish_reason"):
                outcome.finishes[choice["index"]] = choice["finish_reason"]
        finish = item.get("meta_info", {}).get("finish_reason")
        if finish:
            outcome.finishes[item.get("index", position)] = finish["type"]


# ---- checks ------------------------------------------------------------------------------


def outcome_problem(outcome: Outcome) -> str | None:
    """Why this request did not end as planned, or None."""
    plan = outcome.plan
    if outcome.error is not None:
        return f"{outcome.status}: {outcome.error}"
    if plan.kind == "hang_up":
        return None
    expected = {"abort"} if plan.fault else NORMAL_FINISHES
    if plan.kind == "abort_request":
        expected = NORMAL_FINISHES | {"abort"}  # the abort may land after the last token
    if len(outcome.finishes) != plan.num_choices or not set(outcome.finishes.values()) <= expected:
        return f"finishes {outcome.finishes}; expected {sorted(expected)} x {plan.num_choices}"
    return None


def request_checks(outcomes: list[Outcome]) -> dict[str, tuple[bool, str]]:
    statuses = Counter(str(o.status) for o in outcomes)
    problems = [(o.plan.index, o.plan.kind, p) for o in outcomes if (p := outcome_problem(o))]
    unanswered = [o.plan.index for o in outcomes if o.status is None]
    return {
        "every request answered": (not unanswered, f"no answer: {unanswered[:10]}"),
        "no 5xx": (not any(o.status and o.status >= 500 for o in outcomes), str(dict(statuses))),
        "every request ended as planned": (not problems, str(problems[:5])),
    }


async def server_checks(url: str, api_key: str | None) -> tuple[dict, dict[str, Any]]:
    """Once the server is idle: integrity, a flush, then every page free, and health.
    Returns the checks and the server's stats (before the flush)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        info = await _settled_info(session, url)
        status, before = await _get(session, url + "/check_integrity")
        async with session.post(url + "/flush_cache") as resp:
            flushed = (resp.status == 200, (await resp.text()).strip())
        after_status, after = await _get(session, url + "/check_integrity")
        async with session.get(url + "/health") as resp:
            health = resp.status
    num_active = info["num_active_requests"] + info["stats"]["num_running_reqs"]
    leaked = after.get("pool_capacity_pages", -1) - after.get("pool_free_pages", 0)
    checks = {
        "server idle after the run": (num_active == 0, f"{num_active} requests still active"),
        "/check_integrity ok": (status == 200 and before.get("ok") is True, str(before)),
        "/flush_cache ok": flushed,
        "no leaked pages": (after_status == 200 and leaked == 0, f"{leaked} not free: {after}"),
        "/health 200": (health == 200, str(health)),
    }
    return checks, info["stats"] | {"pages_after_flush": after}


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def _settled_info(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """/server_info once nothing runs or waits, or after SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        _, info = await _get(session, url + "/server_info")
        stats = info["stats"]
        busy = info["num_active_requests"] + stats["num_running_reqs"] + stats["num_waiting_reqs"]
        if not busy or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.1)


# ---- the run -----------------------------------------------------------------------------


def run_soak(url: str, config: SoakConfig) -> dict[str, Any]:
    """Sends the mix to the server at `url` and checks it; returns the report."""
    fault_fraction = config.fault_fraction if config.faults else 0.0
    plans = plan_requests(config.num_requests, config.seed, fault_fraction)
    start = time.perf_counter()
    outcomes = asyncio.run(send_all(url, plans, config))
    wall_s = time.perf_counter() - start
    checks, stats = asyncio.run(server_checks(url, config.api_key))
    return summarize(config, outcomes, request_checks(outcomes) | checks, stats, wall_s)


def summarize(config, outcomes: list[Outcome], checks, stats, wall_s: float) -> dict[str, Any]:
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        row = by_kind.setdefault(o.plan.kind, Counter())
        row.update(["sent", f"http {o.status}", *o.finishes.values()])

    def num_aborted(selected) -> int:
        return sum("abort" in o.finishes.values() for o in selected)

    return {
        "config": asdict(config) | {"api_key": None},
        "ok": all(ok for ok, _ in checks.values()),
        "checks": {name: {"ok": ok, "detail": detail} for name, (ok, detail) in checks.items()},
        "requests_by_kind": {kind: dict(row) for kind, row in sorted(by_kind.items())},
        "status_codes": dict(Counter(str(o.status) for o in outcomes)),
        "finish_reasons": dict(Counter(f for o in outcomes for f in o.finishes.values())),
        "faults_injected": sum(o.plan.fault for o in outcomes),
        "aborted": {
            "hung_up_by_client": sum(o.plan.kind == "hang_up" for o in outcomes),
            "by_abort_request": num_aborted(o for o in outcomes if o.plan.kind == "abort_request"),
            "by_injected_fault": num_aborted(o for o in outcomes if o.plan.fault),
        },
        "features": dict(Counter(f for o in outcomes for f in o.plan.features)),
        "problems": [(o.plan.index, o.plan.kind, p) for o in outcomes if (p := outcome_problem(o))],
        "server": {key: stats.get(key) for key in SERVER_STATS}
        | {"pages_after_flush": stats["pages_after_flush"]},
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(outcomes) / wall_s, 2),
    }


def print_report(report: dict[str, Any]) -> None:
    kinds = report["requests_by_kind"]
    columns = sorted({key for row in kinds.values() for key in row} - {"sent"})
    print(f"| kind | sent | {' | '.join(columns)} |\n" + "|---" * (len(columns) + 2) + "|")
    for kind, row in kinds.items():
        cells = " | ".join(str(row.get(column, 0)) for column in columns)
        print(f"| {kind} | {row['sent']} | {cells} |")
    server, pages = report["server"], report["server"]["pages_after_flush"]
    print(f"\nstatus codes {report['status_codes']}; finish reasons {report['finish_reasons']}")
    print(f"faults injected {report['faults_injected']}; aborted {report['aborted']}")
    print(f"cache hit rate {server['cache_hit_rate']:.3f}; evicted pages {server['evicted_pages']}")
    print(f"retractions {server['retractions']}; forward steps {server['forward_steps']}")
    print(f"pages free after the flush {pages['pool_free_pages']} / {pages['pool_capacity_pages']}")
    print(f"wall {report['wall_s']} s; {report['requests_per_s']} req/s\n")
    for name, check in report["checks"].items():
        verdict = "PASS  " if check["ok"] else "FAIL  "
        print(verdict + name + ("" if check["ok"] else f": {check['detail']}"))


# ---- a server of our own -----------------------------------------------------------------


def build_tiny_model(folder: Path) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary (the server borrows its tokenizer), as
    the tests' tiny_chat_model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=2048,
        initializer_range=0.1,
        eos_token_id=None,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def server_env(faults: bool) -> dict[str, str]:
    """What the soak's server needs in its environment: the faults, when armed."""
    return {FAULTS_ENV_VAR: json.dumps(FAULTS)} if faults else {}


@contextmanager
def patched_environ(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def soak_server(model: str, env: dict[str, str], log_path: Path):
    """`radixserve serve MODEL` with SERVER_FLAGS and `env`, on a free port."""
    port = free_port()
    command = [sys.executable, "-m", "radixserve.cli", "serve", model, "--port", str(port)]
    server = ManagedServer(command + SERVER_FLAGS, "/health", log_path, port)
    with patched_environ(env):
        server.start(timeout=600)
    try:
        yield server
    finally:
        server.stop()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=SoakConfig.num_requests, help="how many")
    p.add_argument("--concurrency", type=int, default=SoakConfig.concurrency, help="at once")
    p.add_argument("--seed", type=int, default=SoakConfig.seed, help="of the request mix")
    p.add_argument("--url", help="a running server to soak, instead of starting one")
    p.add_argument("--api-key", help="the --url server's API key")
    p.add_argument("--model", help="model to serve; default: a tiny random Llama")
    faults_help = "send fault- rids (default: on for a server started here, off with --url)"
    p.add_argument("--faults", action=argparse.BooleanOptionalAction, help=faults_help)
    p.add_argument("--fault-fraction", type=float, default=SoakConfig.fault_fraction)
    p.add_argument(
        "--timeout", type=float, default=SoakConfig.request_timeout_s, help="per request, s"
    )
    p.add_argument("--out", default="bench_results/soak.json")
    p.add_argument("--log-dir", default="bench_results/soak_logs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    faults = args.url is None if args.faults is None else args.faults
    config = SoakConfig(
        num_requests=args.requests,
        concurrency=args.concurrency,
        seed=args.seed,
        faults=faults,
        fault_fraction=args.fault_fraction,
        request_timeout_s=args.timeout,
        api_key=args.api_key,
    )
    if args.url:
        report = run_soak(args.url.rstrip("/"), config)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model or str(build_tiny_model(Path(tmp) / "tiny"))
            log_path = Path(args.log_dir) / "server.log"
            with soak_server(model, server_env(faults), log_path) as server:
                report = run_soak(server.url, config)
    print_report(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
