"""A K-quant GGUF's weights stay in the mapped file: each K-quant layer (the head and the
embedding's table included) is a view of the file's pages, not a copy; forwards never write to
them (no page of the mapping turns anonymous); the same file loads twice, with the same logits.
Linux only: the mapping is read from /proc/self/maps and smaps."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_kquant_gguf import VOCAB, _logits, _needs_blocks, _runner, save_llama, write_kquant_gguf

from radixserve.model.quant.block_embedding import BlockEmbedding
from radixserve.model.quant.gguf_weights import read_gguf
from radixserve.model.quant.kquant import KQUANT_TYPES, KQuantLinear

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")


@pytest.fixture(scope="module")
def untied_gguf(tmp_path_factory) -> Path:
    """Q4_K / Q6_K projections, a Q4_K token_embd and a Q6_K output head."""
    root = tmp_path_factory.mktemp("mmap_gguf")
    path = root / "tiny.gguf"
    write_kquant_gguf(save_llama(root / "hf", tie=False), path, head=T.Q6_K, embed=T.Q4_K)
    return Path(os.path.realpath(path))


@pytest.fixture(scope="module")
def two_runners(cpu_ops, untied_gguf):
    _needs_blocks()
    return _runner(untied_gguf), _runner(untied_gguf)


def file_mappings(path: Path) -> list[dict]:
    """This process's mappings of `path`: start, end and smaps' kB fields."""
    mappings, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                current = None
                if len(head) >= 6 and head[5] == str(path):
                    start, end = (int(a, 16) for a in head[0].split("-"))
                    current = {"start": start, "end": end}
                    mappings.append(current)
            elif current is not None and head[0].endswith(":") and len(head) >= 2:
                current[head[0][:-1]] = int(head[1]) if head[1].isdigit() else head[1]
    return mappings


def kquant_layers(model) -> list[KQuantLinear]:
    return [m for m in model.modules() if isinstance(m, KQuantLinear)]


def test_k_quant_weights_are_views_of_the_mapped_file(two_runners, untied_gguf):
    model = two_runners[0].model
    layers = kquant_layers(model)
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert model.embed_tokens.table in layers and model.lm_head in layers
    mappings = file_mappings(untied_gguf)
    assert mappings, "the GGUF is not mapped"
    by_offset = {t.offset: t for t in read_gguf(untied_gguf).tensors}
    file_bytes = untied_gguf.read_bytes()
    seen = set()
    for layer in layers:
        blocks = layer.blocks
        start, end = blocks.data_ptr(), blocks.data_ptr() + blocks.nbytes
        mapping = next((m for m in mappings if m["start"] <= start and end <= m["end"]), None)
        assert mapping is not None, f"{layer} holds a copy, not the mapped file"
        assert blocks.untyped_storage().nbytes() == blocks.nbytes  # the tensor's bytes only
        offset = start - mapping["start"]  # the map starts at the file's first byte
        assert offset in by_offset and by_offset[offset].data.nbytes == blocks.nbytes
        assert blocks.numpy().tobytes() == file_bytes[offset : offset + blocks.nbytes]
        seen.add(offset)
    kquant_tensors = [t for t in by_offset.values() if t.tensor_type.name in KQUANT_TYPES]
    assert len(seen) == len(kquant_tensors) == 14  # projections, the head, the embedding


def test_forwards_never_write_to_the_map_and_two_loads_agree(two_runners, untied_gguf):
    first, second = two_runners
    ours, again = _logits(first), _logits(second)
    assert torch.equal(ours, again)
    assert ours.abs().max() > 0.1
    ids = torch.arange(VOCAB)
    assert torch.equal(first.model.embed_tokens(ids), second.model.embed_tokens(ids))
    mappings = file_mappings(untied_gguf)
    assert len(mappings) >= 2  # one map per load
    for mapping in mappings:  # a written page would be copied into the process: anonymous
        assert mapping["Anonymous"] == 0 and mapping["Private_Dirty"] == 0, mapping


def _mapping_of(path: Path, tensor: torch.Tensor) -> dict:
    start = tensor.data_ptr()
    return next(m for m in file_mappings(path) if m["start"] <= start < m["end"])


def test_release_pages_gives_back_a_views_whole_pages_and_leaves_other_tensors(untied_gguf):
    from radixserve.model.gguf_file import GGUFFile, release_pages

    gguf = GGUFFile(untied_gguf)
    tensor = max((t for t in gguf.tensors if t.tensor_type.name == "Q4_K"), key=lambda t: t.offset)
    view = tensor.torch_bytes()
    before = view.clone()  # reads every page of the view
    resident = _mapping_of(untied_gguf, view)["Rss"]
    released = release_pages(view)
    assert released > 0 and released % 4096 == 0
    assert _mapping_of(untied_gguf, view)["Rss"] == resident - released // 1024
    assert torch.equal(view, before)  # read again: the file's bytes, mapped anew
    plain = before.clone()
    assert release_pages(plain) == 0 and torch.equal(plain, before)


def test_int8_repacks_k_quant_layers_with_the_same_logits(cpu_ops, untied_gguf, monkeypatch):
    """--cpu-quant-activation int8 takes the K-quant layers 8 rows at a time: a copy out of
    the map (its pages given back), the embedding's Q4_K table left a view; and the Q4_0 layer
    (fp16 scales again); logits the bits of the same run on the row layout."""
    from radixserve.model.quant.kquant import X8_TYPE, kquant_x8_native
    from radixserve.model.quant.linear import Int4WeightOnlyLinear
    from radixserve.model.quant.q8_matmul import Q4_0_X8, int4_x8_native

    _needs_blocks()
    if not kquant_x8_native():
        pytest.skip("repacked K-quants run natively with AVX-512 / AVX2 only: never repacked here")
    runner = _runner(untied_gguf, cpu_quant_activation="int8")
    model = runner.model
    repacked = [layer for layer in kquant_layers(model) if layer.qtype > X8_TYPE]
    assert {layer.type_name for layer in repacked} == {"Q4_K", "Q5_K", "Q6_K"}
    assert model.lm_head in repacked  # the Q6_K head
    assert model.embed_tokens.table.qtype == KQUANT_TYPES["Q4_K"][0]
    mappings = file_mappings(untied_gguf)
    for layer in repacked:  # anonymous memory, not the file's pages
        start = layer.blocks.data_ptr()
        assert not any(m["start"] <= start < m["end"] for m in mappings)
    int4 = [m for m in model.modules() if isinstance(m, Int4WeightOnlyLinear)]
    repacked_int4 = [Q4_0_X8] if int4_x8_native() else [None]  # layer 1's o_proj (AVX-512 / AVX2)
    assert [layer.x8_type for layer in int4] == repacked_int4
    monkeypatch.setattr(KQuantLinear, "can_repack", lambda self: False)
    monkeypatch.setattr(Int4WeightOnlyLinear, "can_repack", lambda self: False)
    rows = _runner(untied_gguf, cpu_quant_activation="int8")
    assert not any(layer.qtype > X8_TYPE for layer in kquant_layers(rows.model))
    assert not any(getattr(m, "x8_type", None) for m in rows.model.modules())
    assert torch.equal(_logits(runner), _logits(rows))
