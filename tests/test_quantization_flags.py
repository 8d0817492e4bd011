"""Quantization options refused at start (each naming its flag) and the CLI's quantization
flags and their --help."""

from __future__ import annotations

import re

import pytest
from test_quantization import quantized_runner

from conftest import make_engine
from radixserve.model.quant.quantize import QuantizationError

# ---- options refused at start ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": "fp8"}, "--quantization fp8 needs a CUDA GPU"),
        ({"quantization": "int3"}, "--quantization must be one of"),
        ({"quantization": "int4", "quantization_group_size": 256}, "must be one of 32, 64, 128"),
        ({"quantization": "int4", "quantization_group_size": 128}, "128 does not divide"),
        ({"quantization": "int8", "quantization_group_size": 64}, "int4 only"),
        ({"quantize_lm_head": True}, "--quantize-lm-head needs"),
        ({"cpu_quant_kernel": "fast"}, "--cpu-quant-kernel must be one of auto, blocks, torch"),
    ],
)
def test_bad_options_fail_at_start_naming_the_flag(tiny_models, kwargs, message):
    with pytest.raises(QuantizationError, match=message):
        quantized_runner(tiny_models["llama"], **kwargs)


def test_group_size_message_names_the_layer_and_the_sizes_that_fit(tiny_models):
    with pytest.raises(QuantizationError) as info:
        quantized_runner(tiny_models["llama"], "int4", quantization_group_size=128)
    assert "in_features=64 of self_attn.qkv_proj" in str(info.value)
    assert "sizes that fit every layer: 32, 64" in str(info.value)


def test_engine_rejects_fp8_on_cpu(tiny_chat_model):
    with pytest.raises(QuantizationError, match="--quantization fp8"):
        make_engine(tiny_chat_model, quantization="fp8")


def test_cli_has_the_quantization_flags():
    from radixserve.cli import build_parser

    args = build_parser().parse_args(
        ["generate", "hi", "--quantization", "int4", "--quantization-group-size", "64"]
    )
    assert (args.quantization, args.quantization_group_size) == ("int4", 64)
    assert args.quantize_lm_head is False


def _serve_help(monkeypatch, capsys) -> dict[str, str]:
    """`radixserve serve --help`, unwrapped: each option's flags -> its help text."""
    from radixserve.cli import main

    monkeypatch.setenv("COLUMNS", "100000")  # argparse wraps nothing: one line an option
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    options: dict[str, str] = {}
    flag = None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  --"):  # "  --flag METAVAR   help", or the help on the next line
            invocation, *help_text = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            flag = invocation.split()[0]
            options[flag] = "".join(help_text)
        elif flag is not None and line.startswith("    "):
            options[flag] = f"{options[flag]} {line.strip()}".strip()
        else:
            flag = None
    return options


def test_quantization_help_names_every_gguf_type_and_the_int4_group_size(monkeypatch, capsys):
    from radixserve.model.quant.flag_checks import QUANTIZATION_METHODS
    from radixserve.model.quant.gguf_blocks import AS_IS_TYPES
    from radixserve.model.quant.kquant import KQUANT_TYPES
    from radixserve.model.quant.quantize import INT4_DEFAULT_GROUP_SIZE

    options = _serve_help(monkeypatch, capsys)
    for flag in ("--quantization", "--cpu-quant-kernel"):
        missing = [t for t in (*AS_IS_TYPES, *KQUANT_TYPES) if t not in options[flag]]
        assert not missing, (flag, missing)
    assert all(f"| {method}" in options["--quantization"] for method in QUANTIZATION_METHODS)
    group_size = options["--quantization-group-size"]
    assert f"default: {INT4_DEFAULT_GROUP_SIZE} " in group_size and "None" not in group_size
