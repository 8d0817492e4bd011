"""The frontend language: SGLang's `@function` / gen / select / roles / fork, compiled onto
the batching engine. A program written for `sglang` runs with `import radixserve as sgl`
(or `from radixserve import frontend_lang as sgl`)."""

from radixserve.engine.engine import Engine
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
from radixserve.frontend_lang.program import (
    SglFunction,
    function,
    get_default_backend,
    set_default_backend,
)
from radixserve.frontend_lang.roles import ChatTemplate
from radixserve.frontend_lang.runtime_endpoint import RuntimeEndpoint
from radixserve.frontend_lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend",
    "ChatTemplate",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Engine",
    "EngineBackend",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "SglFunction",
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
