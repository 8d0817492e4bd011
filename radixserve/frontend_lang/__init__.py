"""The frontend language: SGLang's `@function` / gen / select / roles / fork, compiled onto
the batching engine. A program written for `sglang` runs with `import radixserve as sgl`
(or `from radixserve import frontend_lang as sgl`). Every public name of SGLang's frontend
exists here; the few radixserve does not implement (unsupported.py) raise
NotImplementedError saying so."""

from radixserve.client.engine import Engine
from radixserve.frontend_lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixserve.frontend_lang.backends import Backend, EngineBackend
from radixserve.frontend_lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixserve.frontend_lang.global_config import GlobalConfig, global_config
from radixserve.frontend_lang.program import (
    SglFunction,
    function,
    get_default_backend,
    set_default_backend,
)
from radixserve.frontend_lang.roles import ChatTemplate
from radixserve.frontend_lang.runtime_endpoint import RuntimeEndpoint
from radixserve.frontend_lang.state import ProgramState, ProgramStateGroup
from radixserve.frontend_lang.unsupported import (
    Anthropic,
    Crusoe,
    LiteLLM,
    OpenAI,
    Runtime,
    ServerArgs,
    VertexAI,
    image,
    video,
)

__all__ = [
    "Anthropic",
    "Backend",
    "ChatTemplate",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Crusoe",
    "Engine",
    "EngineBackend",
    "GlobalConfig",
    "LiteLLM",
    "OpenAI",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "ServerArgs",
    "SglFunction",
    "VertexAI",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "image",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
