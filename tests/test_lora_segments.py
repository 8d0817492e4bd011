"""The segmented LoRA C++ op (native/csrc/lora_segments.cpp, model/lora_segments.py) against
torch's grouped matmuls of `LoraProjection.add_to`: adapters of different ranks, a slot the
projection lacks, widths off the SIMD lanes, one row to many; a row's result is the same
bits alone or in any batch; bad arguments raise; and `--cpu-lora-kernel auto`'s probe. Listed
in tests/test_cpu_isa_paths.py's KERNEL_TESTS (its AVX2 and portable paths run too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.forward_batch import LoraBatch
from radixserve.model.lora import LoraProjection
from radixserve.model.lora_choice import check_cpu_lora_kernel, probe
from radixserve.model.lora_segments import EVERY_ROW_COUNT, LoraKernel, stack_slots


def _projection(gen, fan_in, fan_out, ranks, kernel=None) -> LoraProjection:
    proj = LoraProjection()
    proj.kernel = kernel
    for slot, rank in ranks.items():
        a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
        proj.put(slot, a, torch.randn(fan_out, rank, generator=gen))
    return proj


def _with_kernel(proj: LoraProjection, ops) -> LoraProjection:
    other = LoraProjection()
    other.kernel = LoraKernel(cpu_ops=ops, cpu_max_rows=EVERY_ROW_COUNT)
    for slot, (a, b) in proj.weights.items():
        other.put(slot, a, b)
    return other


@pytest.mark.parametrize(
    "tokens, fan_in, fan_out, ranks",
    [(1, 64, 192, {0: 12}), (7, 40, 33, {0: 4, 2: 24}), (37, 96, 130, {1: 8, 3: 16, 4: 48})],
)
def test_kernel_equals_torch_grouped_matmuls(cpu_ops, tokens, fan_in, fan_out, ranks):
    gen = torch.Generator().manual_seed(tokens)
    torch_proj = _projection(gen, fan_in, fan_out, ranks)
    ours = _with_kernel(torch_proj, cpu_ops)
    x = torch.randn(tokens, fan_in, generator=gen)
    # slots 0..4 (5: in the pool, not targeting this projection) and the base (-1)
    slots = torch.randint(-1, 6, (tokens,), generator=gen).numpy()
    slots[0] = min(ranks)
    batch = LoraBatch.build(slots, "cpu")
    base = torch.randn(tokens, fan_out, generator=gen)
    want, got = base.clone(), base.clone()
    torch_proj.add_to(want, x, batch)
    ours.add_to(got, x, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[slots < 0], base[slots < 0])  # base rows untouched


def test_a_rows_result_does_not_depend_on_the_batch(cpu_ops):
    gen = torch.Generator().manual_seed(3)
    proj = _with_kernel(_projection(gen, 72, 100, {0: 8, 1: 16}), cpu_ops)
    x = torch.randn(23, 72, generator=gen)
    slots = np.array([i % 3 - 1 for i in range(23)])
    full = torch.zeros(23, 100)
    proj.add_to(full, x, LoraBatch.build(slots, "cpu"))
    for row in (1, 2, 22):
        alone = torch.zeros(1, 100)
        proj.add_to(alone, x[row : row + 1], LoraBatch.build(slots[row : row + 1], "cpu"))
        assert torch.equal(alone[0], full[row]), row


def test_kernel_is_taken_for_fp32_within_its_rows_only(cpu_ops):
    kernel = LoraKernel(cpu_ops=cpu_ops, cpu_max_rows=4)
    small = LoraBatch.build(np.zeros(4, dtype=np.int64), "cpu")
    large = LoraBatch.build(np.zeros(5, dtype=np.int64), "cpu")
    x, out = torch.zeros(4, 8), torch.zeros(4, 8)
    assert kernel.takes(x, out, small)
    assert not kernel.takes(torch.zeros(5, 8), torch.zeros(5, 8), large)
    assert not kernel.takes(x.bfloat16(), out.bfloat16(), small)


def test_stacked_slots_pad_ranks_with_zeros():
    a, b = torch.ones(5, 3), torch.ones(4, 5)
    stacked = stack_slots({1: (a, b)})
    assert stacked.at.shape == (2, 3, 16) and stacked.bt.shape == (2, 16, 4)
    assert stacked.ranks.tolist() == [0, 16]
    assert stacked.at[1, :, 5:].abs().sum() == 0 and stacked.at[0].abs().sum() == 0


def test_bad_arguments_raise(cpu_ops):
    stacked = stack_slots({0: (torch.ones(16, 8), torch.ones(8, 16))})
    out, x = torch.zeros(3, 8), torch.zeros(3, 8)

    def call(rows, offsets, slots=None, x=x):
        slots = torch.tensor([0]) if slots is None else slots
        cpu_ops.lora_segments_add(out, x, rows, offsets, slots, stacked.ranks, stacked.at,
                                  stacked.bt)  # fmt: skip

    with pytest.raises(RuntimeError, match="row index out of range"):
        call(torch.tensor([0, 3]), torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="appears twice"):
        call(torch.tensor([1, 1]), torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="slot out of range"):
        call(torch.tensor([0]), torch.tensor([0, 1]), slots=torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="float32"):
        call(torch.tensor([0]), torch.tensor([0, 1]), x=x.bfloat16())


def test_cpu_lora_kernel_flag_is_checked():
    with pytest.raises(ValueError, match="--cpu-lora-kernel must be one of"):
        check_cpu_lora_kernel("fast", deterministic=False)
    with pytest.raises(ValueError, match="--enable-deterministic-inference needs auto"):
        check_cpu_lora_kernel("torch", deterministic=True)


def test_probe_reports_where_the_kernel_stops_winning(cpu_ops):
    """The verdict follows the measured ratios: ours wins at 1 and 2 rows, loses at 4, wins
    again at 8 (noise past the crossover does not extend it)."""
    seconds = {1: (2.0, 1.0), 2: (2.0, 1.0), 4: (1.0, 2.0), 8: (2.0, 1.0)}  # (torch, ours)

    def fake_times(*calls):
        return seconds[calls[0].args[1].shape[0]]  # args: (out, x, batch)

    result = probe(cpu_ops, [(32, 48, 16)], rows=(1, 2, 4, 8), time_calls=fake_times)
    assert result["max_rows"] == 2 and result["ours_over_torch"] == [0.5, 0.5, 2.0, 0.5]
