"""global_config: SGLang's process-wide frontend settings, under its names and defaults
(`sgl.global_config.verbosity = 2`)."""

from __future__ import annotations

from typing import Any


class GlobalConfig:
    """Mutable frontend settings, read when a program runs."""

    def __init__(self) -> None:
        self.verbosity = 0
        """0: print nothing; 2 or more: print each program's final text when it ends."""
        self.default_backend: Any = None
        """What set_default_backend sets; run() uses it when given no backend."""
        self.skip_special_tokens_in_output = True
        """Sent with every gen as sampling_params.skip_special_tokens."""
        self.spaces_between_special_tokens_in_out = True
        """Sent with every gen as sampling_params.spaces_between_special_tokens."""
        self.enable_precache_with_tracing = True
        """run_batch prefills the constant prefix every input shares before fanning out."""
        self.enable_parallel_encoding = True
        """SGLang's switch between KV concatenation and resending the joined text on
        join("concate_and_append"). Both give the same text here, and radixserve always
        computes the joined text exactly (reusing the cached prefix), so it has no effect."""


global_config = GlobalConfig()
