"""radixserve: an LLM serving runtime built around RadixAttention."""

from radixserve.config import CacheConfig, LoadConfig, ModelConfig

__version__ = "0.1.0"
__all__ = ["CacheConfig", "LoadConfig", "ModelConfig", "__version__"]
