"""Every public name of SGLang's frontend exists in radixserve with SGLang's signature
(parameter names, kinds and defaults), or raises NotImplementedError naming itself.

The expected signatures are SGLang 0.5.23's (python/sglang/__init__.py, lang/api.py,
lang/ir.py SglFunction, lang/interpreter.py ProgramState / ProgramStateGroup,
lang/choices.py, lang/global_config.py), without annotations.
"""

from __future__ import annotations

import inspect

import pytest

import radixserve
import radixserve.frontend_lang as sgl
from radixserve.frontend_lang import api
from radixserve.frontend_lang.backends import EngineBackend
from radixserve.frontend_lang.global_config import GlobalConfig, global_config

# sglang/__init__.py's __all__.
SGLANG_TOP_LEVEL = [
    "Anthropic", "Crusoe", "Engine", "LiteLLM", "OpenAI", "Runtime", "RuntimeEndpoint",
    "ServerArgs", "VertexAI", "__version__", "assistant", "assistant_begin", "assistant_end",
    "flush_cache", "function", "gen", "gen_int", "gen_string", "get_server_info",
    "global_config", "greedy_token_selection", "image", "select", "separate_reasoning",
    "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin",
    "user_end", "video",
]  # fmt: skip

GEN = (
    "name=None, max_tokens=None, min_tokens=None, n=None, stop=None, stop_token_ids=None, "
    "stop_regex=None, temperature=None, top_p=None, top_k=None, min_p=None, "
    "frequency_penalty=None, presence_penalty=None, ignore_eos=None, return_logprob=None, "
    "logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=None, dtype=None, "
    "choices=None, choices_method=None, regex=None, json_schema=None"
)
TYPED_GEN = (
    "name=None, max_tokens=None, n=None, stop=None, stop_token_ids=None, stop_regex=None, "
    "temperature=None, top_p=None, top_k=None, min_p=None, frequency_penalty=None, "
    "presence_penalty=None, ignore_eos=None, return_logprob=None, logprob_start_len=None, "
    "top_logprobs_num=None, return_text_in_logprobs=None"
)
RUN_SAMPLING = (
    "max_new_tokens=128, n=1, stop=None, stop_token_ids=None, stop_regex=None, "
    "temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, frequency_penalty=0.0, "
    "presence_penalty=0.0, ignore_eos=False, return_logprob=None, logprob_start_len=None, "
    "top_logprobs_num=None, return_text_in_logprobs=None"
)

# sglang.lang.api: name -> signature.
# radixserve's own keyword additions, each after SGLang's parameters so that SGLang's calls
# bind as they do there: agent-aware retention and priority (the cache-hierarchy issue).
RETENTION = "priority=None, session_id=None, retention=None"

API = {
    "function": "(func=None, num_api_spec_tokens=None)",
    "set_default_backend": "(backend)",
    "flush_cache": "(backend=None)",
    "get_server_info": "(backend=None)",
    "gen": f"({GEN}, {RETENTION})",
    "gen_int": f"({TYPED_GEN})",
    "gen_string": f"({TYPED_GEN})",
    "image": "(expr)",
    "video": "(path, num_frames)",
    "select": "(name=None, choices=None, temperature=0.0, choices_method=TokenLengthNormalized)",
    "_role_common": "(name, expr=None)",
    "system": "(expr=None)",
    "user": "(expr=None)",
    "assistant": "(expr=None)",
    "system_begin": "()",
    "system_end": "()",
    "user_begin": "()",
    "user_end": "()",
    "assistant_begin": "()",
    "assistant_end": "()",
    "separate_reasoning": "(expr=None, model_type=None)",
    "Runtime": "(*args, **kwargs)",
}

# Methods: (class, name) -> signature.
METHODS = {
    ("SglFunction", "__init__"): "(self, func, num_api_spec_tokens=None, bind_arguments=None)",
    ("SglFunction", "bind"): "(self, **kwargs)",
    ("SglFunction", "run"): (
        f"(self, *args, {RUN_SAMPLING}, stream=False, backend=None, use_thread=True, "
        f"{RETENTION}, **kwargs)"
    ),
    ("SglFunction", "run_batch"): (
        f"(self, batch_kwargs, *, {RUN_SAMPLING}, backend=None, num_threads='auto', "
        "priority=None, progress_bar=False, generator_style=False)"
    ),
    ("SglFunction", "trace"): "(self, *, backend=None, **kwargs)",
    ("SglFunction", "cache"): "(self, backend=None)",
    ("SglFunction", "__call__"): "(self, *args, **kwargs)",
    ("ProgramState", "_role_common"): "(self, name, expr=None)",
    ("ProgramState", "system"): "(self, expr=None)",
    ("ProgramState", "user"): "(self, expr=None)",
    ("ProgramState", "assistant"): "(self, expr=None)",
    ("ProgramState", "var_scope"): "(self, name)",
    ("ProgramState", "fork"): "(self, size=1, position_ids_offset=None)",
    ("ProgramState", "copy"): "(self, position_ids_offset=None)",
    ("ProgramState", "text"): "(self)",
    ("ProgramState", "messages"): "(self)",
    ("ProgramState", "sync"): "(self)",
    ("ProgramState", "error"): "(self)",
    ("ProgramState", "text_iter"): "(self, var_name=None)",
    ("ProgramState", "text_async_iter"): "(self, var_name=None, return_meta_data=False)",
    ("ProgramState", "get_var"): "(self, name)",
    ("ProgramState", "set_var"): "(self, name, value)",
    ("ProgramState", "get_meta_info"): "(self, name)",
    ("ProgramState", "__iadd__"): "(self, other)",
    ("ProgramState", "__getitem__"): "(self, name)",
    ("ProgramState", "__setitem__"): "(self, name, value)",
    ("ProgramState", "__contains__"): "(self, name)",
    ("ProgramState", "__repr__"): "(self)",
    ("ProgramStateGroup", "__init__"): "(self, states, src_state=None)",
    ("ProgramStateGroup", "join"): "(self, mode='gather_variable')",
    ("ProgramStateGroup", "__getitem__"): "(self, i)",
    ("ProgramStateGroup", "__setitem__"): "(self, i, value)",
    ("ProgramStateGroup", "__iadd__"): "(self, other)",
    ("ChoicesSamplingMethod", "__call__"): (
        "(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, "
        "output_token_logprobs, unconditional_token_logprobs=None)"
    ),
}

GLOBAL_CONFIG = {
    "verbosity": 0,
    "default_backend": None,
    "skip_special_tokens_in_output": True,
    "spaces_between_special_tokens_in_out": True,
    "enable_precache_with_tracing": True,
    "enable_parallel_encoding": True,
}


class _Named:
    """A default shown by its type's name (an object's repr holds its address)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def shape(obj) -> str:
    """The signature without annotations; non-literal defaults by their type's name."""
    sig = inspect.signature(obj)
    params = []
    for p in sig.parameters.values():
        default = p.default
        if not (default is p.empty or isinstance(default, (type(None), bool, int, float, str))):
            default = _Named(type(default).__name__)
        params.append(p.replace(annotation=p.empty, default=default))
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def test_every_sglang_top_level_name_is_exported():
    missing = [n for n in SGLANG_TOP_LEVEL if not hasattr(radixserve, n)]
    not_listed = [n for n in SGLANG_TOP_LEVEL if n != "__version__" and n not in sgl.__all__]
    assert missing == [] and not_listed == []


@pytest.mark.parametrize("name", sorted(API))
def test_api_signature(name):
    assert shape(getattr(api, name, None) or getattr(sgl, name)) == API[name]


@pytest.mark.parametrize("cls, name", sorted(METHODS))
def test_method_signature(cls, name):
    assert shape(getattr(getattr(sgl, cls), name)) == METHODS[(cls, name)]


def test_engine_is_radixserves():
    assert sgl.Engine is radixserve.Engine  # SGLang's api.Engine(*args, **kwargs) is its own


def test_global_config_has_sglangs_settings_and_defaults():
    assert vars(GlobalConfig()) == GLOBAL_CONFIG
    assert sgl.global_config is global_config is radixserve.global_config


def _state():
    """A state whose executor is never reached: the calls below fail on their arguments."""
    return sgl.ProgramState(None)


UNSUPPORTED = {
    "image": lambda: sgl.image("cat.png"),
    "video": lambda: sgl.video("clip.mp4", 8),
    "Runtime": lambda: sgl.Runtime(model_path="some/model"),
    "ServerArgs": lambda: sgl.ServerArgs(model_path="some/model"),
    "OpenAI": lambda: sgl.OpenAI("gpt-4o"),
    "Anthropic": lambda: sgl.Anthropic("claude"),
    "LiteLLM": lambda: sgl.LiteLLM("model"),
    "VertexAI": lambda: sgl.VertexAI("gemini"),
    "Crusoe": lambda: sgl.Crusoe("model"),
    "num_api_spec_tokens": lambda: sgl.function(num_api_spec_tokens=64),
    "trace": lambda: sgl.function(lambda s: None).trace(),
    "fork(position_ids_offset": lambda: _state().fork(2, position_ids_offset=[0, 1]),
    "copy(position_ids_offset": lambda: _state().copy(position_ids_offset=[0]).__enter__(),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_names_raise_not_implemented_naming_themselves(name):
    with pytest.raises(NotImplementedError) as info:
        UNSUPPORTED[name]()
    assert str(info.value).startswith(name)


# ---- behaviour behind the signatures -----------------------------------------------------

GREEDY = {"temperature": 0, "ignore_eos": True}
PREAMBLE = "You are a careful assistant who answers in one short sentence. " * 4


class RecordingBackend(EngineBackend):
    def __init__(self, engine):
        super().__init__(engine)
        self.payloads: list[dict] = []

    def request(self, payload):
        self.payloads.append(payload)
        return super().request(payload)


@sgl.function
def ask(s, topic, style="plain"):
    s += PREAMBLE + "Topic: " + topic + " (" + style + ")\nAnswer:"
    s += sgl.gen("answer", max_tokens=2, **GREEDY)


def test_run_sends_sglangs_defaults_and_the_detokenize_options(engine):
    backend = RecordingBackend(engine)
    ask.run("tea", backend=backend, top_k=5)
    sent = backend.payloads[-1]["sampling_params"]
    assert sent["max_new_tokens"] == 2 and sent["temperature"] == 0  # the gen's own
    assert sent["top_k"] == 5 and sent["top_p"] == 1.0 and sent["n"] == 1  # the run's
    assert sent["skip_special_tokens"] is True and sent["spaces_between_special_tokens"] is True


def test_run_batch_takes_positional_lists_and_an_empty_batch(engine):
    backend = EngineBackend(engine)
    by_dict = ask.run_batch([{"topic": "tea"}, {"topic": "tea", "style": "odd"}], backend=backend)
    by_list = ask.run_batch([["tea"], ("tea", "odd")], backend=backend)
    assert [s.text() for s in by_list] == [s.text() for s in by_dict]
    assert ask.run_batch([], backend=backend) == []
    with pytest.raises(TypeError, match="arguments"):
        ask.run_batch([["tea", "odd", "extra"]], backend=backend)


def test_bind_rejects_names_the_program_does_not_take():
    with pytest.raises(TypeError, match="colour"):
        ask.bind(colour="red")


def test_cache_prefills_the_constant_prefix_up_to_the_first_argument(engine):
    backend = RecordingBackend(engine)
    ask.cache(backend=backend)
    assert [p["text"] for p in backend.payloads] == [PREAMBLE + "Topic: "]
    assert backend.payloads[0]["sampling_params"] == {"max_new_tokens": 0}
    backend.payloads.clear()
    sgl.function(lambda s, q: s.__iadd__("Short: " + q)).cache(backend=backend)
    assert backend.payloads == []  # 64 characters or fewer: not worth a request


def test_precache_with_tracing_can_be_switched_off(engine, monkeypatch):
    backend = RecordingBackend(engine)
    batch = [{"topic": f"topic number {i}"} for i in range(3)]
    monkeypatch.setattr(global_config, "enable_precache_with_tracing", False)
    ask.run_batch(batch, backend=backend)
    assert len(backend.payloads) == 3  # no warm-up request
    monkeypatch.setattr(global_config, "enable_precache_with_tracing", True)
    ask.run_batch(batch, backend=backend)
    assert len(backend.payloads) == 3 + 4


def test_verbosity_2_prints_the_final_text(engine, monkeypatch, capsys):
    monkeypatch.setattr(global_config, "verbosity", 2)
    state = ask.run("tea", backend=EngineBackend(engine))
    assert capsys.readouterr().out == state.text() + "\n"


def test_group_append_takes_one_expression_per_fork(engine):
    @sgl.function
    def per_fork(s):
        s += "Root."
        forks = s.fork(2)
        forks += [" a" + sgl.gen("x", max_tokens=1, **GREEDY), " b"]
        texts = [f.text() for f in forks]
        forks.join()
        return texts

    state = per_fork.run(backend=EngineBackend(engine))
    first, second = state.ret_value
    assert first.startswith("Root. a") and len(first) > len("Root. a") and second == "Root. b"
    assert len(state["x"]) == 2 and state["x"][1] is None  # only the first fork generated
    with pytest.raises(ValueError, match="3 expressions to 2 forks"):
        sgl.ProgramStateGroup([_state(), _state()]).__iadd__(["a", "b", "c"])


def test_role_calls_return_the_turn_they_append(engine):
    @sgl.function
    def chat(s):
        return s.user("Hi")

    turn = chat.run(backend=EngineBackend(engine)).ret_value
    assert [type(e).__name__ for e in turn.items] == ["RoleBegin", "Text", "RoleEnd"]
