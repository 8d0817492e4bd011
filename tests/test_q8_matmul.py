"""The int8-activation block matmuls (q8_matmul.py): activations quantized as the torch
reference does bit for bit, every format against the matmul of those quantized activations
(1e-5 of the dot's size) and against the fp32 one (within the activations' rounding), each row
the same bits alone or in any batch; and --cpu-quant-activation's choice (activation_choice.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import assert_same_bits_on_one_and_two_threads
from test_kquant_matmul import random_blocks, reference_weight

from radixserve.model.quant import QuantizationError, activation_choice
from radixserve.model.quant.block_matmul import pack_int4_blocks
from radixserve.model.quant.kquant import (
    KQUANT_TYPES,
    Q4_K_X8,
    Q5_K_X8,
    Q6_K_X8,
    X8_TYPE,
    KQuantLinear,
    kquant_dequantize,
    kquant_matmul,
    kquant_x8_native,
)
from radixserve.model.quant.linear import Int4WeightOnlyLinear
from radixserve.model.quant.q8_matmul import (
    Q4_0_X8,
    Q4_1_X8,
    Q8_BLOCK,
    Q8K_BLOCK,
    int4_block_matmul_q8,
    int4_x8_matmul_q8,
    int4_x8_native,
    int8_block_matmul_q8,
    kquant_matmul_q8,
    quantize_activations,
)

ROWS = (1, 2, 5, 7)
FORMATS = ["int4", "int8", *KQUANT_TYPES]


def case(fmt: str, n: int, k: int, seed: int):
    """(matmul with int8 activations, fp32 weight it stands for, activation block)."""
    gen = torch.Generator().manual_seed(seed)
    if fmt == "int4":
        codes = torch.randint(0, 16, (n, k), generator=gen)
        scale_min = torch.randn(n, k // 32, 2, generator=gen) * 0.05
        weight = (codes.view(n, k // 32, 32) * scale_min[..., :1] + scale_min[..., 1:]).reshape(
            n, k
        )
        qs = pack_int4_blocks(codes)
        return (lambda x: int4_block_matmul_q8(x, qs, scale_min)), weight, Q8_BLOCK
    if fmt == "int8":
        qs = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scales = torch.randn(n, k // 32, generator=gen) * 0.01
        weight = (qs.view(n, k // 32, 32) * scales[..., None]).reshape(n, k)
        return (lambda x: int8_block_matmul_q8(x, qs, scales)), weight, Q8_BLOCK
    blocks = random_blocks(n, k, fmt, seed)
    qtype = KQUANT_TYPES[fmt][0]
    tensor = torch.from_numpy(blocks)
    return (lambda x: kquant_matmul_q8(x, tensor, qtype)), reference_weight(blocks, fmt), Q8K_BLOCK


def dequantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    codes, d = quantize_activations(x, block)
    m, k = x.shape
    return (codes.view(m, k // block, block).double() * d[..., None].double()).reshape(m, k)


@pytest.mark.parametrize("block", [Q8_BLOCK, Q8K_BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_quantizes_activations_as_the_torch_reference(cpu_ops, block, dtype):
    x = (torch.randn(5, 512) * torch.logspace(-3, 2, 512)).to(dtype)
    x[1, :block] = 0  # an all-zero block: scale 0, codes 0
    codes, d = torch.ops.radixserve_cpu.q8_quantize(x, block)
    ref_codes, ref_d = quantize_activations(x, block)
    assert torch.equal(codes, ref_codes) and torch.equal(d, ref_d)
    assert d[1, 0] == 0 and codes.abs().max() == 127


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(37, 768), (5, 1280)])
def test_int8_path_is_the_matmul_of_the_quantized_activations(cpu_ops, fmt, n, k):
    matmul, weight, block = case(fmt, n, k, seed=n + k)
    x = torch.randn(max(ROWS), k)
    out = matmul(x).double()
    xq = dequantized_activations(x, block)
    expected = xq @ weight.double().t()
    magnitude = xq.abs() @ weight.double().abs().t()
    assert ((out - expected).abs() <= 1e-5 * magnitude).all()
    # against fp32 activations: at most half a step of each activation block, times |w|
    _, d = quantize_activations(x, block)
    half_step = d.double().repeat_interleave(block, dim=1) / 2
    bound = half_step @ weight.double().abs().t() + 1e-5 * magnitude
    assert ((out - x.double() @ weight.double().t()).abs() <= bound).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_gives_the_same_bits_alone_or_in_any_batch(cpu_ops, fmt):
    k = 1024  # 40 rows of 1024 int8 codes pass L1: the kernel takes them tile by tile
    matmul, _, _ = case(fmt, 21, k, seed=3)
    x = torch.randn(40, k)
    alone = torch.cat([matmul(x[i : i + 1]) for i in range(len(x))])
    for m in (*ROWS, 40):
        assert torch.equal(matmul(x[:m]), alone[:m]), m
    assert matmul(x.bfloat16()).dtype == torch.bfloat16


def test_bad_inputs_name_the_parameter(cpu_ops):
    blocks = torch.from_numpy(random_blocks(4, 256, "Q4_K", 0))
    with pytest.raises(RuntimeError, match="K must be a multiple of 256"):
        kquant_matmul_q8(torch.randn(1, 128), blocks, 12)
    with pytest.raises(RuntimeError, match="is not Q4_K"):
        kquant_matmul_q8(torch.randn(1, 256), blocks, 3)
    with pytest.raises(RuntimeError, match="qs must be a contiguous uint8"):
        int4_block_matmul_q8(torch.randn(1, 64), torch.zeros(4, 16, dtype=torch.uint8),
                             torch.zeros(4, 2, 2))  # fmt: skip


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize(("n", "k"), [(37, 768), (64, 512)])
def test_repacked_8_rows_at_a_time_gives_the_row_layouts_bits(cpu_ops, type_name, n, k):
    """Every op on the repacked bytes (natively with AVX-512 or AVX2, else unpacked group by group):
    the row layout's results bit for bit, at any number of rows, the tail rows as they lay."""
    ops = torch.ops.radixserve_cpu
    qtype = KQUANT_TYPES[type_name][0]
    blocks = torch.from_numpy(random_blocks(n, k, type_name, n))
    x8, x8_type = ops.kquant_repack_x8(blocks, qtype), qtype + X8_TYPE
    grouped = n // 8 * 8
    assert x8.shape == blocks.shape and torch.equal(x8[grouped:], blocks[grouped:])
    assert not torch.equal(x8[:grouped], blocks[:grouped])
    for m in (*ROWS, 40):
        x = torch.randn(m, k)
        assert torch.equal(kquant_matmul_q8(x, x8, x8_type), kquant_matmul_q8(x, blocks, qtype))
        assert torch.equal(kquant_matmul(x, x8, x8_type), kquant_matmul(x, blocks, qtype)), m
    weight = kquant_dequantize(blocks, qtype)
    assert torch.equal(kquant_dequantize(x8, x8_type), weight)
    for dtype in (torch.float32, torch.bfloat16):
        panel = torch.empty(n - 14, k, dtype=dtype)  # starts and ends inside a group
        ops.kquant_dequantize_into(x8, x8_type, 5, panel)
        assert torch.equal(panel, weight[5 : n - 9].to(dtype))
    with pytest.raises(RuntimeError, match="only Q4_K"):
        ops.kquant_repack_x8(blocks, x8_type)  # repacked already


def test_int8_repacks_k_quant_layers_and_keeps_every_output(cpu_ops):
    if not kquant_x8_native():
        pytest.skip("repacked K-quants run natively with AVX-512 / AVX2 only: never repacked here")
    k = 768
    order = torch.randperm(37)  # llama.cpp's permuted q / k rows: outputs reordered after
    weights = [(torch.from_numpy(random_blocks(n, k, t, n)), t, o) for n, t, o in
               ((37, "Q4_K", order), (16, "Q6_K", None), (16, "Q5_K", None))]  # fmt: skip
    rows = [KQuantLinear(b, t, row_order=o) for b, t, o in weights]
    model = torch.nn.Sequential(*(KQuantLinear(b, t, row_order=o) for b, t, o in weights))
    activation_choice.configure_block_activations(model, "int8", deterministic=False)
    assert [layer.qtype for layer in model] == [Q4_K_X8, Q6_K_X8, Q5_K_X8]
    assert model[0].row_order is None  # the rows repacked in the outputs' order
    for packed, row in zip(model, rows):
        row.int8_activations = True
        for m in (1, 5, 40):
            x = torch.randn(m, k)
            assert torch.equal(packed(x), row(x)), (packed, m)
        assert torch.equal(packed.dequantize(), row.dequantize())
        index = torch.tensor([3, 15, 8, 3])
        assert torch.equal(packed.dequantize_rows(index), row.dequantize_rows(index))
        row.dense_dtype = packed.dense_dtype = torch.float32
        x = torch.randn(130, k)
        assert torch.equal(packed._dense_matmul(x), row._dense_matmul(x))  # fp32 panels
    assert "rows 8 at a time" in repr(model[0])
    with pytest.raises(ValueError, match="cannot repack"):
        model[2].repack_rows8()  # repacked already


def gguf_int4_blocks(n: int, k: int, qtype: int, seed: int):
    """(qs, scale_min) as the loader holds a GGUF Q4_0 (offset -8 x the scale) or Q4_1
    (fp16 offsets): fp16 scales, codes 0..15."""
    gen = torch.Generator().manual_seed(seed)
    qs = pack_int4_blocks(torch.randint(0, 16, (n, k), generator=gen))
    scales = (0.01 + torch.rand(n, k // 32, generator=gen) * 0.04).half().float()
    if qtype == Q4_0_X8:
        offsets = 0 - 8 * scales
    else:  # a block's minimum, about -8 scales: (m + 8 d) - 8 d is m again in fp32
        offsets = (-8 * scales * (0.5 + torch.rand(n, k // 32, generator=gen))).half().float()
    return qs, torch.stack([scales, offsets], dim=-1).contiguous()


@pytest.mark.parametrize("qtype", [Q4_0_X8, Q4_1_X8])
@pytest.mark.parametrize(("n", "k"), [(37, 352), (64, 576), (16, 128)])
def test_repacked_q4_0_and_q4_1_give_the_row_layouts_bits(cpu_ops, qtype, n, k):
    """Q4_0 / Q4_1 8 rows at a time with fp16 scales (natively with AVX-512, else unpacked):
    the row layout's bits at any number of rows; unpacked, the row layout's values."""
    ops = torch.ops.radixserve_cpu
    qs, scale_min = gguf_int4_blocks(n, k, qtype, seed=n + k)
    x8 = ops.int4_repack_x8(qs, scale_min, qtype)
    assert x8.shape == (n, k // 32 * (18 if qtype == Q4_0_X8 else 20))
    for m in (*ROWS, 40):
        x = torch.randn(m, k)
        assert torch.equal(int4_x8_matmul_q8(x, x8, qtype), int4_block_matmul_q8(x, qs, scale_min))
    rows = torch.tensor([n - 1, 0, 9, 3])  # a tail row, rows of two groups
    unpacked_qs, unpacked_scale_min = ops.int4_unpack_x8(x8, qtype, rows)
    assert torch.equal(unpacked_qs, qs[rows]) and torch.equal(unpacked_scale_min, scale_min[rows])
    weight = torch.empty(n, k)
    ops.int4_block_dequantize_into(qs, scale_min, 0, weight)
    for dtype in (torch.float32, torch.bfloat16):  # read in place, from inside a group on
        panel = torch.empty(n - 5, k, dtype=dtype)
        ops.int4_x8_dequantize_into(x8, qtype, 5, panel)
        assert torch.equal(panel, weight[5:].to(dtype))
    inexact = scale_min.clone()
    inexact[3, 1, 0] += 1e-6  # not an fp16 value
    with pytest.raises(RuntimeError, match="is not an fp16"):
        ops.int4_repack_x8(qs, inexact, qtype)


@pytest.mark.parametrize("qtype", [Q4_0_X8, Q4_1_X8])
def test_int8_repacks_gguf_int4_layers_and_keeps_every_output(cpu_ops, qtype):
    if not int4_x8_native():
        pytest.skip("repacked int4 runs natively with AVX-512 / AVX2 only: never repacked here")
    n, k = 37, 352
    qs, scale_min = gguf_int4_blocks(n, k, qtype, seed=1)
    codes = torch.stack([qs.view(n, -1, 16) & 0x0F, qs.view(n, -1, 16) >> 4], 2).reshape(n, k)
    scales, offsets = scale_min.unbind(-1)

    def layer(offsets=offsets):
        zeros = offsets + 8 * scales  # the loader's: w = q * scale + (zero - 8 * scale)
        return Int4WeightOnlyLinear(codes.int(), scales, zeros, 32, backend="blocks")

    model = torch.nn.Sequential(layer(), layer(offsets + 1e-4))  # the second: fp32 offsets
    row = layer()
    assert torch.equal(row.qs, qs) and torch.equal(row.scale_min, scale_min)
    activation_choice.configure_block_activations(model, "int8", deterministic=False)
    assert [m.x8_type for m in model] == [qtype, None]  # fp32 offsets: as they lie
    packed = model[0]
    row.int8_activations = True
    for m in (1, 5, 40):
        x = torch.randn(m, k)
        assert torch.equal(packed(x), row(x)), m
    assert torch.equal(packed.dequantize(), row.dequantize())
    index = torch.tensor([3, 36, 8, 3])
    assert torch.equal(packed.dequantize_rows(index), row.dequantize_rows(index))
    row.dense_dtype = packed.dense_dtype = torch.float32
    x = torch.randn(130, k)
    assert torch.equal(packed._dense_matmul(x), row._dense_matmul(x))  # fp32 panels
    packed.int8_activations = row.int8_activations = False  # fp32 activations: unpacked
    assert torch.equal(packed(x[:3]), row(x[:3]))
    with pytest.raises(ValueError, match="cannot repack"):
        model[1].repack_rows8()
    twin = activation_choice.int8_twin(row)  # what `auto` times int8 on: a repacked copy
    assert twin.x8_type == qtype and row.x8_type is None and torch.equal(row.qs, qs)
    assert torch.equal(
        activation_choice._kernel(twin, x, True), activation_choice._kernel(row, x, True)
    )


@pytest.mark.parametrize("layout", ["int4", "Q6_K", "Q4_K x8", "Q4_0 x8"])
def test_output_rows_split_over_threads_give_the_same_bits(cpu_ops, layout):
    """The int8-activation kernels, in the row layouts and repacked 8 rows at a time: 301
    outputs (groups and a tail) split over two threads give one thread's bits."""
    ops, n, k = torch.ops.radixserve_cpu, 301, 768
    fmt, _, repacked = layout.partition(" ")
    if fmt == "Q4_0":
        qs, scale_min = gguf_int4_blocks(n, k, Q4_0_X8, seed=4)
        matmul, weights = int4_x8_matmul_q8, (ops.int4_repack_x8(qs, scale_min, Q4_0_X8), Q4_0_X8)
    elif repacked:
        qtype = KQUANT_TYPES[fmt][0]
        blocks = torch.from_numpy(random_blocks(n, k, fmt, 4))
        matmul, weights = kquant_matmul_q8, (ops.kquant_repack_x8(blocks, qtype), qtype + X8_TYPE)
    else:
        matmul, weights = case(fmt, n, k, seed=4)[0], ()
    for m in (5, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert_same_bits_on_one_and_two_threads(lambda x=x: matmul(x, *weights))


def _kquant_model(type_name: str = "Q4_K", n: int = 64, k: int = 512) -> torch.nn.Module:
    blocks = torch.from_numpy(random_blocks(n, k, type_name, 1))
    return torch.nn.Sequential(KQuantLinear(blocks, type_name), KQuantLinear(blocks, type_name))


def test_flag_values_set_every_block_layer(cpu_ops):
    model = _kquant_model()
    rows = model[0].blocks  # the row layout, before int8 may repack the layer
    activation_choice.configure_block_activations(model, "int8", deterministic=False)
    assert all(layer.int8_activations for layer in model)
    assert all((layer.qtype == Q4_K_X8) == kquant_x8_native() for layer in model)
    x = torch.randn(3, 512)
    assert torch.equal(model[0](x), kquant_matmul_q8(x, rows, 12))
    model = _kquant_model()
    activation_choice.configure_block_activations(model, "auto", deterministic=False)
    assert not any(layer.int8_activations for layer in model)  # tiny: not measured, fp32
    with pytest.raises(QuantizationError, match="--cpu-quant-activation must be one of auto"):
        activation_choice.configure_block_activations(model, "int4", deterministic=False)


def test_auto_measures_once_per_machine_and_applies_the_table(cpu_ops, monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(activation_choice, "MIN_PROBED_WEIGHTS", 0)
    monkeypatch.setattr(activation_choice, "PROBE_REPEATS", 1)
    calls = []
    real_probe = activation_choice.probe
    monkeypatch.setattr(
        activation_choice, "probe", lambda kinds: calls.append(1) or real_probe(kinds)
    )
    model = _kquant_model()
    activation_choice.configure_block_activations(model, "auto", deterministic=False)
    again = _kquant_model()
    activation_choice.configure_block_activations(again, "auto", deterministic=False)
    assert len(calls) == 1 and (tmp_path / activation_choice.TABLE).exists()
    assert [layer.int8_activations for layer in again] == [
        layer.int8_activations for layer in model
    ]
    assert again[0].dequant_min_rows == model[0].dequant_min_rows
    flagged = _kquant_model()
    activation_choice.configure_block_activations(flagged, "auto", deterministic=True)
    assert not any(layer.int8_activations for layer in flagged)  # deterministic auto: fp32


def test_dense_crossover_follows_the_fitted_lines():
    # kernel 1 ms per row; dense 100 ms + 0.5 ms per row: equal at 200 rows
    assert activation_choice.dense_crossover([64e-3, 256e-3], [132e-3, 228e-3], (64, 256)) == 200
    # dense at least as costly per row as the kernel: never
    assert activation_choice.dense_crossover([64e-3, 256e-3], [80e-3, 400e-3], (64, 256)) is None
    # dense cheaper from the start: still not below a prefill chunk (decodes, short extends)
    floor = activation_choice.MIN_KERNEL_ROWS
    assert activation_choice.dense_crossover([64e-3, 256e-3], [1e-3, 2e-3], (64, 256)) == floor
