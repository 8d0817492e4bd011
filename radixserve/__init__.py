"""radixserve: an LLM serving runtime built around RadixAttention."""

from radixserve.config import CacheConfig, LoadConfig, ModelConfig, SchedulerConfig
from radixserve.engine.engine import Engine
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
