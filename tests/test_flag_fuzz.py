"""Fuzz of the configuration layer: flag combinations drawn by hypothesis (tests/
flag_fuzz_cases.py) are either accepted or refused at start with an error that names one of
the flags drawn (as its Engine keyword `page_size` or its flag `--page-size`): never another
exception type, a traceback from deep inside, or a nonsense value let through.

    Engine keywords   engine/preflight.py `verify_engine_args`: every check made before a
                      model loads, run alone (no model)
    command lines     `serve`, `generate`, `fleet` through cli.main, with what would start the
                      core / the model / the fleet replaced by a stub: argparse's usage error,
                      or SystemExit("radixserve <command>: ...")
    accepted values   a few important numeric flags drawn in range start an Engine on a tiny
                      model and generate

Every bug the fuzz found is an explicit example in tests/test_flag_fuzz_regressions.py.
"""

from __future__ import annotations

import pytest
from flag_fuzz_cases import (
    REFUSALS,
    assert_names_one,
    cli_flags,
    command_options,
    engine_kwargs,
    run_cli,
    stub_starts,
)
from fuzz_common import FUZZ_SETTINGS, MAX_EXAMPLES
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import greedy, prompt_ids
from radixserve import Engine
from radixserve.engine.preflight import verify_engine_args

ENGINE_EXAMPLES = 4 * MAX_EXAMPLES  # a check is a fraction of a millisecond
CLI_EXAMPLES = 2 * MAX_EXAMPLES
START_EXAMPLES = max(MAX_EXAMPLES // 10, 1)  # each starts an Engine and generates (~1 s)


# ---- Engine keywords, checked without a model ---------------------------------------------


@settings(FUZZ_SETTINGS, max_examples=ENGINE_EXAMPLES)
@given(kwargs=engine_kwargs())
def test_engine_keywords_are_accepted_or_refused_naming_one(kwargs):
    try:
        verify_engine_args(None, dict(kwargs))
    except REFUSALS as exc:
        assert_names_one(str(exc), kwargs)


# ---- command lines, through cli.main -----------------------------------------------------


COMMANDS = {
    "serve": ["serve"],
    "generate": ["generate", "hi"],
    "fleet": ["fleet"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_lines_are_accepted_or_refused_naming_one(command, monkeypatch):
    stub_starts(monkeypatch)
    options = command_options(command)

    @settings(FUZZ_SETTINGS, max_examples=CLI_EXAMPLES)
    @given(flags=cli_flags(options))
    def check(flags):
        refusal = run_cli([*COMMANDS[command], *flags])
        if refusal is not None:
            assert_names_one(refusal, [f.split("=")[0] for f in flags if f.startswith("--")])

    check()


# ---- accepted numeric flags start an Engine and generate ----------------------------------

START_VALUES = {
    "page_size": st.sampled_from([1, 3, 16, 64]),
    "max_total_tokens": st.sampled_from([64, 512, 4096]),
    "chunked_prefill_size": st.sampled_from([-1, 1, 5, 64]),
    "max_prefill_tokens": st.sampled_from([1, 8, 16384]),
    "max_running_requests": st.sampled_from([1, 2, 256]),
    "context_length": st.sampled_from([None, 17, 2048]),
    "schedule_conservativeness": st.sampled_from([0.0, 0.3, 10.0]),
    "schedule_policy": st.sampled_from(["lpm", "dfs-weight", "fcfs"]),
    "disable_radix_cache": st.booleans(),
    "attention_backend": st.sampled_from(["auto", "torch_native"]),
    "enable_deterministic_inference": st.booleans(),
    "speculative_algorithm": st.sampled_from([None, "NGRAM", "SUFFIX", "SELF"]),
    "speculative_num_draft_tokens": st.sampled_from([1, 4, 16]),
    "speculative_self_layers": st.just(1),  # SELF: fewer than the tiny model's 2 layers
}


@settings(FUZZ_SETTINGS, max_examples=START_EXAMPLES)
@given(kwargs=st.fixed_dictionaries(START_VALUES))
def test_accepted_numeric_flags_start_an_engine_that_generates(tiny_chat_model, kwargs):
    """Prompts of 12 tokens and 4 new ones fit every pool and context drawn."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    try:
        verify_engine_args(tiny_chat_model, dict(kwargs))
        engine = Engine(tiny_chat_model, **kwargs)
    except ValueError as exc:  # a pool too small for a page names --max-total-tokens
        assert_names_one(str(exc), kwargs)
        return
    try:
        prompts = [prompt_ids(i, 12) for i in range(2)]
        outputs = engine.generate(input_ids=prompts, sampling_params=greedy(4))
        assert [len(out["output_ids"]) for out in outputs] == [4, 4]
        engine.check_integrity()
    finally:
        engine.shutdown()
