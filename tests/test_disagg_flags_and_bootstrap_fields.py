"""Disaggregation's flags and a request's bootstrap fields: bad ones are refused naming the
flag or the field; the fields ride on the request spec, one room per output."""

from __future__ import annotations

import pytest
from disagg_cores import HOST

from radixserve.client.request_builder import GenerateArgs, RequestBuilder
from radixserve.config import DisaggregationConfig, SchedulerConfig
from radixserve.engine.protocol import Bootstrap


@pytest.mark.parametrize(
    ("config", "tp_size", "flag"),
    [
        (DisaggregationConfig(disaggregation_mode="both"), 1, "--disaggregation-mode"),
        (DisaggregationConfig(disaggregation_transfer_backend="nixl"), 1, "-transfer-backend"),
        (DisaggregationConfig(disaggregation_transfer_timeout=0), 1, "--disaggregation-transfer"),
        (DisaggregationConfig(disaggregation_bootstrap_port=70000), 1, "-bootstrap-port"),
        (DisaggregationConfig(disaggregation_mode="decode"), 2, "--tp-size"),
    ],
)
def test_bad_disaggregation_flags_are_refused_naming_the_flag(config, tp_size, flag):
    with pytest.raises(ValueError, match=flag):
        config.verify(SchedulerConfig(), tp_size)


def test_decode_without_the_radix_cache_is_refused_at_start():
    config = DisaggregationConfig(disaggregation_mode="decode")
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        config.verify(SchedulerConfig(disable_radix_cache=True), 1)
    DisaggregationConfig(disaggregation_mode="prefill").verify(SchedulerConfig(), 1)


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 200 + 1 for c in text]


def builder(mode: str | None) -> RequestBuilder:
    return RequestBuilder(_Tokenizer(), 256, 512, 4096, disaggregation_mode=mode)


BOOT = {"bootstrap_host": HOST, "bootstrap_port": 8998, "bootstrap_room": 5}


def test_bootstrap_fields_ride_on_the_request_spec():
    specs, _ = builder("decode").build(GenerateArgs(text="hi", **BOOT))
    assert specs[0].bootstrap == Bootstrap(HOST, 8998, 5)
    batch = GenerateArgs(text=["a", "b"], **(BOOT | {"bootstrap_room": [1, 2]}))
    specs, _ = builder("prefill").build(batch)
    assert [s.bootstrap.room for s in specs] == [1, 2]
    specs, _ = builder(None).build(GenerateArgs(text="hi"))
    assert specs[0].bootstrap is None


@pytest.mark.parametrize(
    ("mode", "fields", "message"),
    [
        (None, BOOT, "bootstrap_host needs a worker started with --disaggregation-mode"),
        ("decode", {"bootstrap_room": 5}, "bootstrap_host is missing"),
        ("decode", BOOT | {"bootstrap_host": ""}, "bootstrap_host must be"),
        ("decode", BOOT | {"bootstrap_port": "8998"}, "bootstrap_port must be"),
        ("decode", BOOT | {"bootstrap_port": 0}, "bootstrap_port must be"),
        ("decode", BOOT | {"bootstrap_room": -1}, "bootstrap_room must be"),
        ("decode", BOOT | {"bootstrap_room": 1 << 64}, "bootstrap_room must be"),
        ("decode", BOOT | {"bootstrap_room": True}, "bootstrap_room must be"),
        ("decode", BOOT | {"bootstrap_room": [1, 2]}, "bootstrap_room has 2 entries"),
    ],
)
def test_bad_bootstrap_fields_are_refused_naming_the_field(mode, fields, message):
    with pytest.raises(ValueError, match=message):
        builder(mode).build(GenerateArgs(text="hi", **fields))


def test_a_room_pairs_one_output_only():
    args = GenerateArgs(text="hi", sampling_params={"n": 2}, **BOOT)
    with pytest.raises(ValueError, match="n must be 1"):
        builder("decode").build(args)
