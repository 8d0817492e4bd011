"""The segmented LoRA Triton kernel (radixserve_kernels.lora_segments) against its torch
reference on CPU under TRITON_INTERPRET=1: segments of different ranks and lengths (one
longer than a row block), a slot without weights, the base rows untouched; fp32 only (the
interpreter is slow: a few small cases)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit of ours runs

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixserve.forward_batch import LoraBatch  # noqa: E402
from radixserve.model.lora_segments import stack_slots  # noqa: E402
from radixserve_kernels.lora_segments import segmented_lora  # noqa: E402
from radixserve_kernels.reference import segmented_lora_ref  # noqa: E402


@pytest.mark.parametrize("tokens, fan_in, fan_out", [(5, 48, 40), (21, 32, 70)])
def test_segmented_lora_matches_reference(tokens, fan_in, fan_out):
    gen = torch.Generator().manual_seed(tokens)
    weights = {}
    for slot, rank in {0: 8, 2: 20}.items():  # slots 1, 3: in the pool, not here
        a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
        weights[slot] = (a, torch.randn(fan_out, rank, generator=gen))
    stacked = stack_slots(weights)
    slots = np.array([(i % 5) - 1 for i in range(tokens)])  # base, 0, 1, 2, 3 in turn
    slots[tokens // 2 :] = 2  # one segment longer than a row block at 21 tokens
    batch = LoraBatch.build(slots, "cpu")
    x = torch.randn(tokens, fan_in, generator=gen)
    out = torch.randn(tokens, fan_out, generator=gen)
    args = (batch.rows, batch.offsets, batch.slot_ids, stacked.ranks, stacked.at, stacked.bt)
    want = segmented_lora_ref(out, x, *args)
    got = out.clone()
    longest = max(end - start for _, start, end in batch.segments)
    segmented_lora(got, x, *args, longest)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[slots < 0], out[slots < 0])
    assert not torch.equal(got[slots == 2], out[slots == 2])
