"""Speculative decoding side by side with plain decoding: greedy decode speed and acceptance
on the default model, one CPU thread by default.

Workloads (chat-templated): `tool_echo`, agents asked to copy their tool's JSON result (the
first round of radixserve_bench's `tool-echo` workload); `json_extract`, a JSON record
extracted from a document in the prompt; `free_chat`, open-ended answers (little to look
up); `json_schema`, the same documents extracted under a JSON schema with many fixed keys
(constrained decoding: jump-forward appends the keys unsampled); `agent_repeat`, workload
(e) of issue #28: repeated agent tasks, one instruction (a shipping agent's fixed plan)
run for many orders, one wave of --batch-size requests after another, so outputs repeat
across requests and later waves draft from earlier ones. Modes: `off`, `ngram`, `suffix`,
`auto` (workload (g): AUTO, NGRAM or SUFFIX per request and step, plus EAGLE3 given
--eagle-head; the `drafted by` column counts its picks), `eagle3` (workload (f) on
`free_chat`: the EAGLE-3 head at --eagle-head, default the shipped one, under
--eagle-adaptive-threshold), `self` (the target's first
--self-layers layers draft), `standalone` (a draft model;
default: the target itself, an acceptance ceiling that shows the drafting cost, since no
smaller model with SmolLM2's tokenizer ships offline), `no_jump` (no speculation and
--disable-jump-forward: against `off` it shows what jump-forward does).

Each run first prefills its prompts into the cache (max_new_tokens 0), then times the
batch's generation (agent_repeat: its waves, in order), so tok/s is decode speed
(completion tokens / wall time) and `cpu tok/s` the same per second of this process's CPU
time (steadier on a shared machine: one torch thread, the engine in-process). Modes run
interleaved, `--repeats` times, the median is reported; NGRAM, SUFFIX and AUTO start each
run with empty stores (agent_repeat's first wave is
cold, the later ones learn from those before). Greedy outputs are compared with `off` (the
`identical` column); `forwards` counts the engine's forward steps; constrained outputs are
checked against their schema (`valid`).

Run:  python benchmarks/speculative.py [--modes off,ngram,suffix,auto,eagle3,self,standalone]
      [--batch-sizes 1,8] [--max-new-tokens 128] [--repeats 2] [--threads 1]
      [--agent-inputs 8] [--suffix-num-draft-tokens K]
Prints a table and writes all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import jsonschema
import torch

from radixserve import Engine
from radixserve.engine.speculative import (
    AutoDrafter,
    NgramDrafter,
    SuffixDrafter,
    create_drafter,
)
from radixserve.model.source import default_model_path
from radixserve.native.machine import describe_cpu
from radixserve_bench.workloads import default_tokenizer, make_workload

TOPICS = [
    "a lighthouse keeper", "a lost robot", "a city garden", "an old violin", "a desert",
    "a night train", "a chess club", "a mountain village",
]  # fmt: skip
PEOPLE = [
    ("Ana Ribeiro", "Lisbon", 1987, "architect"), ("Tomas Berg", "Oslo", 1975, "pilot"),
    ("Mei Tanaka", "Osaka", 1992, "chemist"), ("Luca Conti", "Turin", 1968, "baker"),
    ("Sara Haddad", "Beirut", 1990, "lawyer"), ("Ivan Petrov", "Sofia", 1983, "teacher"),
    ("Nora Quinn", "Cork", 1979, "nurse"), ("Omar Diallo", "Dakar", 1995, "engineer"),
]  # fmt: skip


def tool_echo_messages(num: int) -> list[list[dict]]:
    """The first round of the bench `tool-echo` workload, one user message per agent."""
    tokenizer = default_tokenizer()
    workload = make_workload("tool-echo", tokenizer, preset="small", overrides={"num_agents": num})
    return [
        [{"role": "user", "content": tokenizer.decode(r.new_ids)}] for r in workload.requests[:num]
    ]


def json_extract_messages(num: int) -> list[list[dict]]:
    messages = []
    for name, city, year, job in (PEOPLE * 2)[:num]:
        document = (
            f"{name} was born in {city} in {year}. After school, {name.split()[0]} trained as "
            f"an {job} and has worked as one ever since, mostly in {city}. Friends describe "
            f"{name.split()[0]} as patient and curious."
        )
        ask = 'Extract {"name", "city", "birth_year", "job"} from the document as JSON.'
        messages.append([{"role": "user", "content": f"Document:\n{document}\n\n{ask}"}])
    return messages


def free_chat_messages(num: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Write a short story about {topic}."}]
        for topic in (TOPICS * 2)[:num]
    ]


TEXT_KEYS = ["full_name", "home_city", "occupation", "country_of_residence", "employer"]
TRAITS = ["patient", "curious", "calm", "bold"]
RECORD = {
    "type": "object",
    "properties": {
        **{key: {"type": "string", "maxLength": 24} for key in TEXT_KEYS},
        "birth_year": {"type": "integer", "minimum": 1900, "maximum": 2020},
        "is_employed": {"type": "boolean"},
        "years_in_current_job": {"type": "integer", "minimum": 0, "maximum": 60},
        "personality_traits": {"type": "array", "items": {"enum": TRAITS}, "maxItems": 2},
        "record_source": {"enum": ["document"]},
    },
    "additionalProperties": False,
}
RECORD["required"] = list(RECORD["properties"])


def json_schema_messages(num: int) -> list[list[dict]]:
    """json_extract's documents, asked for RECORD (the schema constrains the output)."""
    ask = "Extract the person's record from the document as JSON."
    return [
        [{"role": "user", "content": m[0]["content"].rsplit("\n\n", 1)[0] + "\n\n" + ask}]
        for m in json_extract_messages(num)
    ]


AGENT_INSTRUCTION = (
    "You are a shipping agent. For each order, reply with a plan in exactly this format:\n"
    "Step 1: Check the order in the database.\nStep 2: Print the shipping label.\n"
    "Step 3: Pack the item in a box.\nStep 4: Send the box to the customer.\n"
    "Step 5: Email the customer the tracking number.\nThen write: Done."
)
ITEMS = [
    "a blue kettle", "two desk lamps", "a winter coat", "a coffee grinder", "three novels",
    "a bicycle helmet", "a yoga mat", "a pair of boots",
]  # fmt: skip


def agent_repeat_messages(num: int) -> list[list[dict]]:
    """One instruction for `num` orders (workload (e): repeated agent tasks)."""
    orders = [(item, person[0]) for item, person in zip(ITEMS * 4, PEOPLE * 4)][:num]
    return [
        [
            {"role": "system", "content": AGENT_INSTRUCTION},
            {"role": "user", "content": f"Order: {item} for {name}."},
        ]
        for item, name in orders
    ]


WORKLOADS = {
    "tool_echo": tool_echo_messages,
    "json_extract": json_extract_messages,
    "free_chat": free_chat_messages,
    "json_schema": json_schema_messages,
    "agent_repeat": agent_repeat_messages,
}
WAVES = {"agent_repeat"}
"""Workloads that run --agent-inputs requests in waves of the batch size, not one batch."""
CONSTRAINTS = {"json_schema": {"json_schema": RECORD}}
"""Sampling parameters a workload adds (its constraint)."""


def mode_flags(mode: str, args) -> dict:
    draft = args.draft_model or str(default_model_path())
    return {
        "off": {},
        "ngram": {"speculative_algorithm": "NGRAM"},
        "suffix": {
            "speculative_algorithm": "SUFFIX",
            "speculative_num_draft_tokens": args.suffix_num_draft_tokens or args.num_draft_tokens,
            "speculative_adaptive_threshold": args.suffix_adaptive_threshold,
        },
        "auto": {"speculative_algorithm": "AUTO"}
        | ({"speculative_draft_model_path": args.eagle_head} if args.eagle_head else {}),
        "eagle3": {
            "speculative_algorithm": "EAGLE3",
            "speculative_adaptive_threshold": args.eagle_adaptive_threshold,
        }
        | ({"speculative_draft_model_path": args.eagle_head} if args.eagle_head else {}),
        "self": {"speculative_algorithm": "SELF", "speculative_self_layers": args.self_layers},
        "standalone": {
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": draft,
        },
        "no_jump": {"disable_jump_forward": True},
    }[mode]


def timed_run(engine: Engine, waves: list[list[str]], max_new_tokens: int, extra: dict) -> dict:
    """Prefills the prompts of all `waves` into the cache, then times their greedy
    generation, one wave (a batch) after another (`extra`: the workload's constraint)."""
    drafter = engine.scheduler.drafter
    if isinstance(drafter, (NgramDrafter, SuffixDrafter)):  # an empty store
        engine.scheduler.drafter = create_drafter(engine.scheduler.config)
    elif isinstance(drafter, AutoDrafter):  # empty stores (an EAGLE3 head kept: no store)
        auto = create_drafter(replace(engine.scheduler.config, speculative_draft_model_path=None))
        engine.scheduler.drafter = AutoDrafter(auto.lookups, drafter.model)
    prompts = [p for wave in waves for p in wave]
    engine.generate(prompt=prompts, sampling_params={"max_new_tokens": 0})
    params = {"temperature": 0, "max_new_tokens": max_new_tokens} | extra
    forwards = engine.get_stats()["forward_steps"]
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = [o for wave in waves for o in engine.generate(prompt=wave, sampling_params=params)]
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    metas = [o["meta_info"] for o in outputs]
    tokens = sum(m["completion_tokens"] for m in metas)
    lengths = [m["spec_accept_length"] for m in metas if "spec_accept_length" in m]
    return {
        "output_ids": [o["output_ids"] for o in outputs],
        "completion_tokens": tokens,
        "tok_s": tokens / wall,
        "cpu_tok_s": tokens / cpu,
        "drafted_by": drafted_by(metas),
        "forwards": engine.get_stats()["forward_steps"] - forwards,
        "row_cost": measured_row_cost(engine, len(waves[0])),
        "jump_forward_tokens": sum(m.get("jump_forward_tokens", 0) for m in metas),
        "spec_accept_length": statistics.mean(lengths) if lengths else None,
        "valid": all_valid(outputs, extra.get("json_schema")),
    }


def measured_row_cost(engine: Engine, batch_size: int) -> float | None:
    """The draft row's cost in decode steps the engine's adaptive policy has measured (None:
    no speculation, or not measured yet)."""
    speculator = engine.scheduler.speculator
    fit = speculator and speculator.row_costs
    return fit.row_cost(batch_size) if fit and fit.measured else None


def drafted_by(metas: list[dict]) -> dict[str, int]:
    """Verify steps per algorithm that drafted them ("none": no draft), over all requests."""
    total: dict[str, int] = {}
    for meta in metas:
        for name, num in meta.get("spec_drafter_verify_ct", {}).items():
            total[name] = total.get(name, 0) + num
    return total


def all_valid(outputs: list[dict], schema: dict | None) -> bool | None:
    """Whether every output is an instance of `schema` (None: no schema)."""
    if schema is None:
        return None
    try:
        for out in outputs:
            jsonschema.validate(json.loads(out["text"]), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_workload(engines: dict, template, name: str, batch_size: int, args) -> list[dict]:
    num = args.agent_inputs if name in WAVES else batch_size
    messages = WORKLOADS[name](num)
    prompts = [template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    waves = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    runs = {mode: [] for mode in engines}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            extra = CONSTRAINTS.get(name, {})
            runs[mode].append(timed_run(engine, waves, args.max_new_tokens, extra))
    base = statistics.median(r["tok_s"] for r in runs["off"]) if "off" in runs else None
    cpu_base = statistics.median(r["cpu_tok_s"] for r in runs["off"]) if "off" in runs else None
    rows = []
    for mode, mode_runs in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in mode_runs)
        cpu_tok_s = statistics.median(r["cpu_tok_s"] for r in mode_runs)
        last = mode_runs[-1]
        rows.append(
            {
                "workload": name,
                "batch_size": batch_size,
                "mode": mode,
                "completion_tokens": last["completion_tokens"],
                "forwards": last["forwards"],
                "jump_forward_tokens": last["jump_forward_tokens"],
                "tok_s": tok_s,
                "speedup": tok_s / base if base else None,
                "cpu_tok_s": cpu_tok_s,
                "cpu_speedup": cpu_tok_s / cpu_base if cpu_base else None,
                "drafted_by": last["drafted_by"],
                "row_cost": last["row_cost"],
                "spec_accept_length": last["spec_accept_length"],
                "identical": last["output_ids"] == runs["off"][-1]["output_ids"]
                if "off" in runs
                else None,
                "valid": last["valid"],
            }
        )
    return rows


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'workload':>12} {'batch':>5} {'mode':>10} {'tokens':>6} {'forwards':>8} "
        f"{'jumped':>6} {'tok/s':>7} {'speedup':>7} {'cpu tok/s':>9} {'cpu x':>6} "
        f"{'accept len':>10} {'identical':>9} {'valid':>5}  drafted by"
    )
    for r in rows:
        speedup = f"{r['speedup']:6.2f}x" if r["speedup"] else "      -"
        cpu_speedup = f"{r['cpu_speedup']:5.2f}x" if r["cpu_speedup"] else "     -"
        drafted = " ".join(f"{k}:{v}" for k, v in sorted(r["drafted_by"].items()))
        length = f"{r['spec_accept_length']:10.2f}" if r["spec_accept_length"] else "         -"
        print(
            f"{r['workload']:>12} {r['batch_size']:5d} {r['mode']:>10} "
            f"{r['completion_tokens']:6d} {r['forwards']:8d} {r['jump_forward_tokens']:6d} "
            f"{r['tok_s']:7.1f} {speedup} {r['cpu_tok_s']:9.1f} {cpu_speedup} {length} "
            f"{str(r['identical']):>9} {str(r['valid']):>5}  {drafted}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--modes", default="off,ngram,suffix,self,standalone")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument(
        "--suffix-num-draft-tokens", type=int, default=None, help="default: --num-draft-tokens"
    )
    parser.add_argument("--agent-inputs", type=int, default=8, help="agent_repeat: requests")
    parser.add_argument(
        "--suffix-adaptive-threshold",
        type=float,
        default=1.0,
        help="SUFFIX's --speculative-adaptive-threshold (0: drafts wherever the trees match)",
    )
    parser.add_argument("--self-layers", type=int, default=6, help="SELF: layers that draft")
    parser.add_argument("--draft-model", default=None, help="STANDALONE; default: the target")
    parser.add_argument(
        "--eagle-head", default=None, help="eagle3, and auto's candidate; default: the shipped head"
    )
    parser.add_argument(
        "--eagle-adaptive-threshold",
        type=float,
        default=1.0,
        help="eagle3's --speculative-adaptive-threshold (0: always drafts)",
    )
    parser.add_argument("--quantization", default=None, help="none: the fp32 model")
    parser.add_argument(
        "--cpu-quant-activation", default=None, help="the engines' --cpu-quant-activation"
    )
    parser.add_argument("--out", default="bench_results/speculative.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common = {"speculative_num_draft_tokens": args.num_draft_tokens}
    load = {} if args.quantization is None else {"quantization": args.quantization}
    if args.cpu_quant_activation is not None:
        load["cpu_quant_activation"] = args.cpu_quant_activation
    engines = {}
    for mode in args.modes.split(","):
        flags = mode_flags(mode, args)
        speculative = "speculative_algorithm" in flags
        engines[mode] = Engine(args.model, **load, **(common | flags if speculative else flags))
    template = next(iter(engines.values())).tokenizer.apply_chat_template
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for name in args.workloads.split(","):
            rows += run_workload(engines, template, name, batch_size, args)
            print_rows(rows[-len(engines) :])
    print()
    print_rows(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"machine": describe_cpu(), "torch": torch.__version__}
    print(f"CPU: {info['machine']}")
    out.write_text(json.dumps({"args": vars(args), "info": info, "rows": rows}, indent=2))
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
