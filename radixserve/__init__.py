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

# The frontend language under SGLang's top-level names: `import radixserve as sgl` runs
# programs written for `import sglang as sgl`.
from radixserve.frontend_lang import (  # noqa: E402
    EngineBackend,
    RuntimeEndpoint,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    greedy_token_selection,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
)

__all__ += [
    "EngineBackend",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_server_info",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
