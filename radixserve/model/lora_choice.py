"""Where a LoRA model's adapter deltas run (`--cpu-lora-kernel`), chosen once at start.

On the CPU the segmented C++ kernel (lora_segments.py) pays none of torch's per-op dispatch
(a gather, two matmuls per adapter, a scatter-add, per projection and layer) but is one FMA
chain per output: faster than torch's BLAS at decode-sized batches, slower at prefill
chunks, and where the two cross depends on the CPU, its BLAS and the thread count. So `auto`
measures, once per machine, both on the model's four fused projections (an adapter of rank
PROBE_RANK on every module, the rows split over two adapters) at each of PROBE_ROWS adapter
rows, and runs the kernel up to the largest row count at and below which it was never
slower (0: never). The answer is cached by `dense_choice.py`'s table machinery
(<cache_root>/lora_choice.json, keyed by CPU, torch, threads and shapes; a file lock keeps
two processes from measuring at once), so it never changes within a process.

`segmented` runs the kernel at every row count, as `--enable-deterministic-inference` does
(its rows round alike in any batch; torch's BLAS does not promise that); `torch` never.
On CUDA the Triton kernel (radixserve_kernels.lora_segments) runs every LoRA batch.
Models smaller than MIN_PROBED_HIDDEN (tests' tiny ones) are not measured: `auto` keeps
torch's there, where the choice could only follow noise.
"""

from __future__ import annotations

import hashlib
import json
import logging
from functools import partial

import torch

from radixserve.config import ModelConfig
from radixserve.config.lora import CPU_LORA_KERNELS
from radixserve.disk_cache import cache_root
from radixserve.forward_batch import LoraBatch
from radixserve.model.lora_adapter import module_shape
from radixserve.model.lora_segments import EVERY_ROW_COUNT, LoraKernel
from radixserve.model.quant.dense_choice import best_times, cached_measurement

logger = logging.getLogger(__name__)

MIN_PROBED_HIDDEN = 256
PROBE_RANK = 16  # per PEFT module: qkv stacks 3 of them, gate_up 2
PROBE_ROWS = (1, 4, 16, 64, 256, 1024)  # decode .. a prefill chunk, 4x apart
PROBE_VERSION = 1  # part of the cache key: a change to how the probe measures re-measures


def check_cpu_lora_kernel(choice: str, deterministic: bool) -> None:
    """Raises naming the flag unless `choice` is a known value that fits the other flags."""
    if choice not in CPU_LORA_KERNELS:
        allowed = ", ".join(CPU_LORA_KERNELS)
        raise ValueError(f"--cpu-lora-kernel must be one of {allowed}; got {choice!r}")
    if deterministic and choice == "torch":
        raise ValueError(
            "--cpu-lora-kernel torch is not batch-invariant: --enable-deterministic-inference "
            "needs auto or segmented"
        )


def lora_kernel(
    config: ModelConfig, choice: str, device: torch.device, deterministic: bool = False
) -> LoraKernel | None:
    """The kernel a LoRA model's projections take on `device` (None: torch's always)."""
    check_cpu_lora_kernel(choice, deterministic)
    if device.type == "cuda":
        return LoraKernel(triton=_triton_available())
    if choice == "torch" or device.type != "cpu":
        return None
    from radixserve.native.extension import CpuExtensionUnavailable, load_cpu_ops

    try:
        ops = load_cpu_ops()
    except CpuExtensionUnavailable as exc:
        if choice == "segmented" or deterministic:
            raise ValueError(f"--cpu-lora-kernel {choice}: {exc}") from exc
        return None
    if choice == "segmented" or deterministic:
        return LoraKernel(cpu_ops=ops, cpu_max_rows=EVERY_ROW_COUNT)
    if config.hidden_size < MIN_PROBED_HIDDEN:
        return None
    shapes = probe_shapes(config)
    key = _probe_key(shapes)
    path = cache_root() / "lora_choice.json"
    measured = cached_measurement(key, lambda: probe(ops, shapes), path, required="max_rows")
    return LoraKernel(cpu_ops=ops, cpu_max_rows=int(measured["max_rows"]))


def _triton_available() -> bool:
    try:
        import radixserve_kernels.lora_segments  # noqa: F401
    except ImportError:
        logger.warning("Triton is not importable: LoRA deltas run on torch's matmuls")
        return False
    return True


def probe_shapes(config: ModelConfig, rank: int = PROBE_RANK) -> list[tuple[int, int, int]]:
    """(in, out, stacked rank) of the fused projections, every module adapted at `rank`."""
    shapes = []
    for modules in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                    ("down_proj",)):  # fmt: skip
        fan_in = module_shape(config, modules[0])[0]
        fan_out = sum(module_shape(config, m)[1] for m in modules)
        shapes.append((fan_in, fan_out, rank * len(modules)))
    return shapes


def _probe_key(shapes: list[tuple[int, int, int]]) -> str:
    from radixserve.native.machine import describe_cpu

    text = json.dumps([PROBE_VERSION, describe_cpu(), torch.__version__,
                       torch.get_num_threads(), shapes, PROBE_ROWS])  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def probe(ops, shapes: list[tuple[int, int, int]], rows=PROBE_ROWS, time_calls=best_times):
    """Seconds of every projection's adapter deltas, kernel vs torch, at each row count, and
    `max_rows`: the largest count at and below which the kernel was never slower.
    `time_calls(*calls)` -> each call's seconds (dense_choice's best of interleaved runs)."""
    from radixserve.model.lora import LoraProjection

    gen = torch.Generator().manual_seed(0)
    seconds = {"torch": [0.0] * len(rows), "ours": [0.0] * len(rows)}
    for fan_in, fan_out, rank in shapes:
        torch_proj, ours = LoraProjection(), LoraProjection()
        ours.kernel = LoraKernel(cpu_ops=ops, cpu_max_rows=EVERY_ROW_COUNT)
        for slot in (0, 1):
            a = torch.randn(rank, fan_in, generator=gen) * 0.01
            b = torch.randn(fan_out, rank, generator=gen) * 0.01
            torch_proj.put(slot, a, b)
            ours.put(slot, a, b)
        for i, count in enumerate(rows):
            x = torch.randn(count, fan_in, generator=gen)
            out = torch.zeros(count, fan_out)
            batch = _two_adapters(count)
            calls = (partial(torch_proj.add_to, out, x, batch), partial(ours.add_to, out, x, batch))
            torch_s, ours_s = time_calls(*calls)
            seconds["torch"][i] += torch_s
            seconds["ours"][i] += ours_s
    ratios = [o / max(t, 1e-9) for o, t in zip(seconds["ours"], seconds["torch"])]
    max_rows = 0
    for count, ratio in zip(rows, ratios):
        if ratio > 1.0:
            break
        max_rows = count
    return {"max_rows": max_rows, "rows": list(rows), "ours_over_torch": ratios,
            "seconds": seconds}  # fmt: skip


def _two_adapters(count: int) -> LoraBatch:
    """`count` rows, the first half on slot 0 and the rest on slot 1 (one row: slot 0)."""
    slots = torch.zeros(count, dtype=torch.int64)
    slots[count // 2 :] = 1 if count > 1 else 0
    return LoraBatch.build(slots.numpy(), "cpu")
