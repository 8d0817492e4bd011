"""LoraConfig: which LoRA adapters the engine serves beside its base model (SGLang's flags)."""

from __future__ import annotations

import os
from dataclasses import dataclass

LORA_EVICTION_POLICIES = ("lru", "fifo")
"""SGLang's --lora-eviction-policy values."""

CPU_LORA_KERNELS = ("auto", "segmented", "torch")
"""--cpu-lora-kernel values (model/lora_choice.py)."""

LORA_NAME_FORBIDDEN = "\x00"
"""Adapter names may not hold NUL (nor may cache salts with LoRA on: the core joins a salt
and an adapter's load id with it, engine/request.py `cache_namespace`)."""


@dataclass
class LoraConfig:
    """Multi-LoRA serving: PEFT adapter folders loaded at start, chosen per request."""

    enable_lora: bool = False
    """Serve LoRA adapters (SGLang's flag); implied by --lora-paths."""
    lora_paths: list[str] | None = None
    """Adapters to load at start, each `name=path` or a bare path (named by its folder):
    PEFT folders with adapter_config.json and adapter_model.safetensors. A request picks
    one by name (`lora_path` on /generate, `model` in OpenAI bodies, Engine's `lora_path`)."""
    max_loras_per_batch: int = 8
    """Most distinct adapters in one batch (SGLang's default 8): the slots of the adapter
    pool the forward reads. Requests of a further adapter wait until a slot frees (the base
    model takes none)."""
    max_loaded_loras: int | None = None
    """Most adapters held in memory (SGLang's flag): loading one past it is refused until one
    is unloaded. At least --max-loras-per-batch and the number of --lora-paths. Default (unlike
    SGLang's none): the larger of those two, so held adapters always have a bound."""
    lora_eviction_policy: str = "lru"
    """Which held adapter leaves a full pool slot for another one: `lru` (least recently
    used, SGLang's default) or `fifo` (first put in the pool). Never one a running request
    uses."""
    max_lora_rank: int | None = None
    """Largest adapter rank accepted; an adapter of higher rank is refused at start.
    Default: any rank."""
    cpu_lora_kernel: str = "auto"
    """On the CPU, where fp32 adapter deltas run: `auto` (the segmented C++ kernel up to the
    batch size where a once-per-machine measurement, cached, finds it faster than torch's
    matmuls; torch's beyond), `segmented` (the kernel at every batch size, as
    --enable-deterministic-inference does), `torch` (torch's grouped matmuls). On CUDA the
    Triton kernel runs every LoRA batch."""

    def verify(self) -> None:
        if self.cpu_lora_kernel not in CPU_LORA_KERNELS:
            raise ValueError(
                f"--cpu-lora-kernel must be one of {', '.join(CPU_LORA_KERNELS)}; "
                f"got {self.cpu_lora_kernel!r}"
            )
        if self.max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1; got {self.max_loras_per_batch}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1; got {self.max_lora_rank}")
        if self.lora_paths is not None and not isinstance(self.lora_paths, list | tuple):
            raise ValueError(f"--lora-paths must be a list of name=path; got {self.lora_paths!r}")
        if self.lora_eviction_policy not in LORA_EVICTION_POLICIES:
            raise ValueError(
                f"--lora-eviction-policy must be one of {', '.join(LORA_EVICTION_POLICIES)}; "
                f"got {self.lora_eviction_policy!r}"
            )
        loaded = self.max_loaded_loras
        if loaded is not None and loaded < self.max_loras_per_batch:
            raise ValueError(
                f"--max-loaded-loras ({loaded}) must be at least --max-loras-per-batch "
                f"({self.max_loras_per_batch})"
            )
        num = len(self.adapter_paths())
        if loaded is not None and num > loaded:
            raise ValueError(
                f"--lora-paths names {num} adapters but --max-loaded-loras is {loaded}"
            )

    @property
    def loaded_limit(self) -> int:
        """The most adapters held: --max-loaded-loras, or its default."""
        if self.max_loaded_loras is not None:
            return self.max_loaded_loras
        return max(self.max_loras_per_batch, len(self.adapter_paths()))

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

    def adapter_paths(self) -> dict[str, str]:
        """name -> folder of every adapter in --lora-paths, names checked unique."""
        adapters: dict[str, str] = {}
        for entry in self.lora_paths or ():
            name, path = parse_lora_path(entry)
            if name in adapters:
                raise ValueError(f"--lora-paths names the adapter {name!r} twice")
            adapters[name] = path
        return adapters


def parse_lora_path(entry: str) -> tuple[str, str]:
    """`name=path` -> (name, path); a bare path is named by its last folder."""
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"--lora-paths entries must be name=path or a path; got {entry!r}")
    name, sep, path = entry.partition("=")
    if not sep:
        path = entry
        name = os.path.basename(os.path.normpath(entry))
    if not name or not path or LORA_NAME_FORBIDDEN in name:
        raise ValueError(f"--lora-paths entry {entry!r} needs a non-empty name (no NUL) and path")
    return name, path


def check_lora_name(name: object) -> None:
    """An adapter name: a non-empty string without NUL."""
    if not isinstance(name, str) or not name or LORA_NAME_FORBIDDEN in name:
        raise ValueError(f"lora_name must be a non-empty string without NUL; got {name!r}")
