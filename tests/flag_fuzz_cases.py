"""What the flag fuzz (tests/test_flag_fuzz.py) draws: for every Engine keyword a few values
in range and the odd ones (0, negative, huge, a float or a string where an int goes, NaN,
inf, unknown names, empty strings), in groups of flags that interact (speculative decoding
with its companions, quantization with its kernels, tp with ep / nodes / LoRA / the tier,
...), and the same as command-line text for `serve`, `generate` and `fleet`; and how it and
its regressions (tests/test_flag_fuzz_regressions.py) check a refusal and run a command."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from collections.abc import Iterable

from hypothesis import strategies as st

from radixserve.cli import build_parser, main
from radixserve.config.field_types import flag_of
from radixserve.engine.preflight import verify_engine_args
from radixserve.model.source import ModelLoadError

NAN, INF = math.nan, math.inf
ODD_NUMBERS = [0, -1, -(2**63), 2**63, 10**30, 1.5, -0.5, NAN, INF, -INF, True, "8", None]
"""Whatever a keyword's type, one of these is out of range or of the wrong type for it."""
ODD_STRINGS = ["", " ", "bogus", "AUTO", "\x00", "none", 7, None]
ODD_VALUES = ODD_NUMBERS + ODD_STRINGS


def _values(*good) -> list:
    """Values of the keyword's type, some in range, some not (the odd ones of any type are
    ODD_VALUES, drawn for some keywords of some examples)."""
    return list(good)


BOOL = _values(True, False)
COUNT = _values(1, 2, 4, 64)
FRACTION = _values(0.0, 0.3, 1.0, 1e-9)
SECONDS = _values(0.5, 30.0, 1e9)

ENGINE_VALUES: dict[str, list] = {
    # load
    "load_format": _values("auto", "safetensors", "gguf", "dummy"),
    "dtype": _values("auto", "float32", "bfloat16", "float16", "int8"),
    "device": _values("auto", "cpu", "cuda", "cuda:1", "cpu:0", "meta", "mps"),
    "seed": _values(0, 7, 2**40),
    "quantization": _values("auto", "none", "int8", "int4", "fp8", "gguf", "gptq", "awq"),
    "quantization_group_size": _values(32, 64, 128, 16, 33),
    "quantize_lm_head": BOOL,
    "cpu_quant_kernel": _values("auto", "blocks", "torch"),
    "cpu_quant_activation": _values("auto", "fp32", "int8"),
    "cpu_dense_kernel": _values("auto", "packed", "torch"),
    "cpu_decode_stack": _values("auto", "off"),
    "enable_deterministic_inference": BOOL,
    # KV cache
    "page_size": _values(1, 16, 64, 2**20),
    "max_total_tokens": _values(16, 4096, 10**7),
    "mem_fraction_static": _values(0.85, 1.0, 0.01, 1.2),
    "cpu_kv_cache_gb": _values(0.5, 4.0, 1e-12),
    "attention_backend": _values("auto", "torch_native", "cpu_fused", "triton", "flashinfer"),
    "disable_cuda_graph": BOOL,
    "cuda_graph_max_bs": COUNT,
    "enable_torch_compile": BOOL,
    "torch_compile_max_bs": COUNT,
    "kv_cache_dtype": _values("auto", "float32", "bfloat16", "float16", "fp8"),
    "kv_events_config": _values(
        '{"enable_kv_cache_events": true, "publisher": "null"}',
        '{"enable_kv_cache_events": false}',
        '{"enable_kv_cache_events": "yes"}',
        '{"hwm": 0}',
        '{"bogus": 1}',
        '{"endpoint": "http://x"}',
        "[]",
        "{",
    ),
    "swa_full_tokens_ratio": _values(0.8, 1.0, 0.01, 1.5),
    "disable_hybrid_swa_memory": BOOL,
    # scheduler
    "schedule_policy": _values("lpm", "dfs-weight", "fcfs", "LPM"),
    "chunked_prefill_size": _values(-1, 1, 64, 2048, -2),
    "max_prefill_tokens": COUNT,
    "max_running_requests": COUNT,
    "disable_radix_cache": BOOL,
    "schedule_max_bypass": COUNT,
    "schedule_tier_match_weight": FRACTION,
    "enable_priority_scheduling": BOOL,
    "max_pinned_fraction": FRACTION,
    "max_pins": COUNT,
    "pin_policy": _values("hard", "last"),
    "schedule_conservativeness": _values(0.0, 0.3, 1.0, 10.0),
    "context_length": _values(1, 64, 2048, 10**6),
    "grammar_cache_size": COUNT,
    "disable_jump_forward": BOOL,
    # speculative decoding
    "speculative_algorithm": _values(
        "NGRAM", "ngram", "SELF", "STANDALONE", "SUFFIX", "EAGLE", "EAGLE3", "AUTO", "MEDUSA"
    ),
    "speculative_num_draft_tokens": _values(1, 2, 4, 8, 64),
    "speculative_num_steps": _values(1, 2, 3, 5),
    "speculative_eagle_topk": _values(1, 2, 4, 8),
    "speculative_draft_model_path": _values("/no/such/head", "head"),
    "speculative_self_layers": _values(1, 2, 100),
    "speculative_adaptive_threshold": _values(0.0, 1.0, 3.5),
    "speculative_disable_by_batch_size": COUNT,
    "speculative_ngram_min_match_window_size": _values(1, 2, 12),
    "speculative_ngram_max_match_window_size": _values(1, 12, 4),
    "speculative_ngram_capacity": _values(1, 100_000),
    "speculative_suffix_max_tree_depth": _values(2, 24, 1),
    "speculative_suffix_max_spec_factor": _values(0.5, 1.0, 4.0),
    "speculative_suffix_min_token_prob": FRACTION,
    "speculative_suffix_max_cached_requests": _values(0, 1, 10000),
    "speculative_suffix_max_cached_tokens": _values(1, 262_144),
    # parallelism
    "tp_size": _values(1, 2, 4, 3),
    "ep_size": _values(1, 2, 4),
    "dist_backend": _values("auto", "nccl", "gloo", "mpi"),
    "dist_init_addr": _values(
        "127.0.0.1:0", "127.0.0.1:29500", "0.0.0.0:29500", "[::1]:70000", "host", ":80", "[::]:1"
    ),
    "dist_timeout": SECONDS,
    "nnodes": _values(1, 2, 3),
    "node_rank": _values(0, 1, 2),
    # prefill / decode disaggregation
    "disaggregation_mode": _values("null", "prefill", "decode", "both"),
    "disaggregation_bootstrap_port": _values(0, 8998, 65535, 65536),
    "disaggregation_bootstrap_host": _values("127.0.0.1", "localhost", "0.0.0.0", "::1"),
    "disaggregation_transfer_backend": _values("tcp", "fake", "rdma"),
    "disaggregation_secret_file": _values("/no/such/secret"),
    "disaggregation_room_budget_mb": _values(0, 64),
    "disaggregation_transfer_timeout": SECONDS,
    # hierarchical cache (never a folder it could create: --hicache-dir is made by verify)
    "enable_hierarchical_cache": BOOL,
    "hicache_ratio": _values(2.0, 0.5, 1e-9),
    "hicache_size": _values(0.0, 0.001, 4.0),
    "hicache_write_policy": _values("write_through", "write_back", "write_through_selective"),
    "hicache_dir": ["", "/proc/radixserve-fuzz", "/dev/null/tier", 3, None],
    # LoRA
    "enable_lora": BOOL,
    "lora_paths": [
        ["a=/x"],
        ["/x/b"],
        ["a=/x", "a=/y"],
        ["=/x"],
        ["a="],
        [""],
        ["\x00=/x"],
        "a=/x",
    ],
    "max_loras_per_batch": COUNT,
    "max_loaded_loras": COUNT,
    "lora_eviction_policy": _values("lru", "fifo", "LRU"),
    "max_lora_rank": COUNT,
    "cpu_lora_kernel": _values("auto", "segmented", "torch"),
}

_GROUPS = {
    "load": list(ENGINE_VALUES)[:12],
    "cache": ["page_size", "max_total_tokens", "mem_fraction_static", "cpu_kv_cache_gb",
              "attention_backend", "cuda_graph_max_bs", "enable_torch_compile",
              "torch_compile_max_bs", "kv_cache_dtype", "kv_events_config",
              "swa_full_tokens_ratio", "disable_hybrid_swa_memory",
              "enable_deterministic_inference"],
    "scheduler": ["schedule_policy", "chunked_prefill_size", "max_prefill_tokens",
                  "max_running_requests", "disable_radix_cache", "schedule_max_bypass",
                  "schedule_tier_match_weight", "enable_priority_scheduling",
                  "max_pinned_fraction", "max_pins", "pin_policy", "schedule_conservativeness",
                  "context_length", "grammar_cache_size", "page_size", "max_total_tokens"],
    "speculative": [k for k in ENGINE_VALUES if k.startswith("speculative_")]
    + ["tp_size", "enable_lora", "disable_radix_cache"],
    "parallel": ["tp_size", "ep_size", "dist_backend", "dist_init_addr", "dist_timeout",
                 "nnodes", "node_rank", "quantization", "enable_hierarchical_cache",
                 "speculative_algorithm", "enable_lora", "disaggregation_mode"],
    "disaggregation": [k for k in ENGINE_VALUES if k.startswith("disaggregation_")]
    + ["disable_radix_cache", "tp_size"],
    "hicache": ["enable_hierarchical_cache", "hicache_ratio", "hicache_size",
                "hicache_write_policy", "hicache_dir", "disable_radix_cache", "tp_size",
                "enable_lora", "schedule_tier_match_weight"],
    "lora": ["enable_lora", "lora_paths", "max_loras_per_batch", "max_loaded_loras",
             "lora_eviction_policy", "max_lora_rank", "cpu_lora_kernel", "tp_size",
             "speculative_algorithm", "enable_hierarchical_cache"],
}  # fmt: skip
"""Flags that interact, drawn together; `any` draws from all of them."""


@st.composite
def engine_kwargs(draw) -> dict:
    """1 to 5 keywords, mostly of one group, with values of their types; in half of the
    examples one of them is an odd value of any type instead. The speculative group usually
    names an algorithm (its companions are refused without one)."""
    group = draw(st.sampled_from(sorted(_GROUPS) + ["any"]))
    names = _GROUPS.get(group, sorted(ENGINE_VALUES))
    keys = draw(st.lists(st.sampled_from(names), min_size=1, max_size=5, unique=True))
    if group == "speculative" and draw(st.booleans()):
        keys = ["speculative_algorithm", *(k for k in keys if k != "speculative_algorithm")]
    kwargs = {key: draw(st.sampled_from(ENGINE_VALUES[key])) for key in keys}
    if draw(st.booleans()):
        kwargs[draw(st.sampled_from(keys))] = draw(st.sampled_from(ODD_VALUES))
    return kwargs


# ---- checking a refusal -------------------------------------------------------------------

REFUSALS = (TypeError, ValueError, ModelLoadError)
"""What a refused flag raises: a wrong type, a value or combination refused, a model (or
draft model) not found."""
ALIASES = {"model_path": "model"}  # --model-path is --model's alias (the same setting)


def assert_names_one(message: str, names: Iterable[str]) -> None:
    """`message` names one of `names` (keywords or flags), as keyword or as flag."""
    words = {n.lstrip("-").replace("-", "_") for n in names}
    words = {ALIASES.get(w, w.removeprefix("no_")) for w in words} | words
    named = [w for w in words if w in message or flag_of(w) in message]
    assert named, f"{message!r} names none of {sorted(words)}"


# ---- running a command line, up to what it would start -----------------------------------


class Started(Exception):
    """Raised by the stubs where the command would start the core, model or fleet."""


def stub_starts(monkeypatch) -> None:
    """What `serve`, `generate` and `fleet` would start raises Started instead: the engine
    core (serve's own checks, of parser names and --host, run first), the model (after the
    Engine's checks) and the fleet's processes."""
    import radixserve.client.core_start as core_start
    import radixserve.client.engine as engine_module
    import radixserve.fleet.launch as fleet_launch
    import radixserve.model.tp_node as tp_node
    import radixserve.server.launch as server_launch

    def engine(**kwargs):  # `generate`: the Engine's checks, then no model
        verify_engine_args(kwargs.pop("model", None), kwargs)
        raise Started

    def start(*args, **kwargs):
        raise Started

    monkeypatch.setattr(core_start, "set_openmp_defaults", lambda: True)
    monkeypatch.setattr(server_launch, "MultiprocessClient", start)  # serve's own checks run
    monkeypatch.setattr(server_launch, "import_tokenizer_library", lambda: None)
    monkeypatch.setattr(fleet_launch, "run_fleet", start)
    monkeypatch.setattr(tp_node, "serve_node", start)
    monkeypatch.setattr(engine_module, "Engine", engine)


def run_cli(argv: list[str]) -> str | None:
    """None if the command got to its start; else its one-line refusal (argparse's usage
    error or SystemExit's message)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            main(argv)
    except Started:
        return None
    except SystemExit as exc:
        if isinstance(exc.code, str):
            return exc.code
        assert exc.code == 2, f"{argv}: exit code {exc.code}"
        return stderr.getvalue().strip().splitlines()[-1]  # "radixserve ...: error: ..."
    raise AssertionError(f"{argv}: main returned without starting or refusing")


def command_options(command: str) -> dict[str, str]:
    """The command's flags -> bool | list | value (not --help, nor --hicache-dir, which the
    checks create)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {}
    for action in sub.choices[command]._actions:
        flag = next((s for s in action.option_strings if s.startswith("--")), None)
        if flag in (None, "--help", "--hicache-dir"):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            options[flag] = "bool"
        else:
            options[flag] = "list" if action.nargs == "+" else "value"
    return options


# ---- the command line -------------------------------------------------------------------

ODD_TEXT = ["0", "-1", "1.5", "nan", "inf", "-inf", "1e999", "9" * 30, "", " ", "bogus", "0x10"]


@st.composite
def cli_flags(draw, options: dict[str, str]) -> list[str]:
    """1 to 4 of a command's `options` (flag -> kind: value | bool | list), each with a
    value in range (what the Engine fuzz draws, as text) or an odd text."""
    flags = draw(st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=4, unique=True))
    argv = []
    for flag in flags:
        kind = options[flag]
        if kind == "bool":
            argv.append(draw(st.sampled_from([flag, "--no-" + flag[2:]])))
            continue
        if kind == "list":
            entries = st.sampled_from(["a=/x", "/x/b", "=/x", "a=", "", "a=/y"])
            argv += [flag, *draw(st.lists(entries, min_size=1, max_size=2))]
            continue
        name = flag[2:].replace("-", "_")
        good = ENGINE_VALUES.get(name, ["1", "8", "auto", "info", "127.0.0.1"])
        value = draw(st.sampled_from([str(v) for v in good]) | st.sampled_from(ODD_TEXT))
        argv.append(f"{flag}={value}")  # `=`: a value such as "-inf" is not read as a flag
    return argv
