"""radixserve: an LLM serving runtime built around RadixAttention."""

from radixserve.client.engine import Engine
from radixserve.config import CacheConfig, LoadConfig, ModelConfig, SchedulerConfig
from radixserve.sampling.params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "CacheConfig",
    "Engine",
    "LoadConfig",
    "ModelConfig",
    "SamplingParams",
    "SchedulerConfig",
    "__version__",
]

# The frontend language under SGLang's top-level names: `import radixserve as sgl` runs
# programs written for `import sglang as sgl`.
from radixserve import frontend_lang as _frontend_lang  # noqa: E402
from radixserve.frontend_lang import *  # noqa: E402, F403

__all__ += [name for name in _frontend_lang.__all__ if name not in __all__]
