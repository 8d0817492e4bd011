"""The frontend language's primitives on both backends: the in-process Engine and a running
`radixserve serve` (RuntimeEndpoint). The tiny model is random: these tests check structure,
chat-template rendering and agreement with the engine's own numbers, never content."""

from __future__ import annotations

import json
import re
import threading

import pytest

import radixserve.frontend_lang as sgl
from radixserve.frontend_lang import EngineBackend, RuntimeEndpoint

GREEDY = {"temperature": 0, "ignore_eos": True}


# ---- gen, +=, run ------------------------------------------------------------------------


@sgl.function
def complete(s, prompt):
    s += prompt
    s += sgl.gen("out", max_tokens=5, **GREEDY)


def test_gen_appends_and_stores_what_the_engine_generates(backend, engine):
    state = complete.run(prompt="The capital of France is", backend=backend)
    direct = engine.generate("The capital of France is", {"max_new_tokens": 5} | GREEDY)
    assert state["out"] == direct["text"]
    assert state.text() == "The capital of France is" + direct["text"]
    meta = state.get_meta_info("out")
    assert meta["completion_tokens"] == 5 and meta["finish_reason"]["type"] == "length"


def test_run_level_defaults_and_gen_overrides(backend):
    @sgl.function
    def two(s):
        s += "Count:" + sgl.gen("a") + ";" + sgl.gen("b", max_tokens=2)

    state = two.run(backend=backend, max_new_tokens=3, temperature=0, ignore_eos=True)
    assert state.get_meta_info("a")["completion_tokens"] == 3
    assert state.get_meta_info("b")["completion_tokens"] == 2
    assert state.text() == "Count:" + state["a"] + ";" + state["b"]


def test_default_backend_accepts_an_engine_and_call_runs(engine):
    sgl.set_default_backend(engine)
    try:
        state = complete("Hello")
        assert isinstance(sgl.get_default_backend(), EngineBackend)
        assert state.text().startswith("Hello") and state["out"]
    finally:
        sgl.set_default_backend(EngineBackend(engine))


def test_bind_positional_args_and_return_value(backend):
    @sgl.function
    def greet(s, name, punctuation):
        s += f"Hi {name}{punctuation}"
        return len(s.text())

    state = greet.bind(punctuation="!").run("Ada", backend=backend)
    assert state.text() == "Hi Ada!" and state.ret_value == len("Hi Ada!")


def test_control_flow_on_a_generated_value(backend):
    @sgl.function
    def branch(s):
        s += "Pick a number: " + sgl.gen_int("n", max_tokens=3, temperature=0)
        if s["n"] % 2 == 0:
            s += " is even"
        else:
            s += " is odd"
        for i in range(2):
            s += f" step{i}" + sgl.gen(f"x{i}", max_tokens=1, **GREEDY)

    state = branch.run(backend=backend)
    n = state["n"]
    assert isinstance(n, int)
    parity = "even" if n % 2 == 0 else "odd"
    assert state.text().startswith(f"Pick a number: {n} is {parity} step0")
    assert "x1" in state and "x2" not in state


# ---- constrained gens --------------------------------------------------------------------


def test_constrained_gens_go_through_the_engine_grammar(backend):
    schema = {"type": "string", "enum": ["red", "green", "blue"]}

    @sgl.function
    def typed(s):
        s += "Animal: " + sgl.gen("animal", regex="(cat|dog)s?", temperature=0)
        s += "\nFlag: " + sgl.gen("flag", dtype=bool, temperature=0)
        s += "\nRatio: " + sgl.gen("ratio", dtype="float", max_tokens=5, temperature=0)
        s += "\nColor: " + sgl.gen("color", json_schema=json.dumps(schema), temperature=0)
        s += "\nName: " + sgl.gen_string("name", max_tokens=6, temperature=0)

    state = typed.run(backend=backend)
    assert re.fullmatch("(cat|dog)s?", state["animal"])
    assert state["flag"] in (True, False)
    assert isinstance(state["ratio"], float)
    assert json.loads(state["color"]) in schema["enum"]
    assert state["name"].startswith('"')


# ---- roles -------------------------------------------------------------------------------


def test_roles_render_exactly_the_chat_template(backend):
    @sgl.function
    def chat(s):
        s += sgl.system("You answer briefly.")
        s += sgl.user("What is 2+2?")
        s += sgl.assistant("4")
        with s.user():
            s += "And 3+3?"
        s += sgl.assistant_begin()
        s += "6"
        s += sgl.assistant_end()

    state = chat.run(backend=backend)
    rendered = backend.tokenizer.apply_chat_template(state.messages(), tokenize=False)
    assert state.text() == rendered
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]


def test_the_template_default_system_prompt_is_written_consistently(backend):
    @sgl.function
    def ask(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=3, **GREEDY))

    one, two = ask.run("Hi", backend=backend), ask.run("Bye", backend=backend)
    tokenizer = backend.tokenizer
    head = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert one.text().startswith(head)  # SmolLM2's template injects its system prompt
    assert one.messages()[0]["role"] == "system"
    system_block = head[: head.index("<|im_start|>user")]
    ids_one, ids_two = backend.encode(one.text()), backend.encode(two.text())
    shared = backend.encode(system_block + "<|im_start|>user\n")
    assert ids_one[: len(shared)] == ids_two[: len(shared)] == shared
    assert one.messages()[-1]["content"] == one["answer"].lstrip()


# ---- select ------------------------------------------------------------------------------


def _expected_scores(engine, prefix: str, choices: list[str]) -> list[float]:
    """Mean logprob of each choice's tokens, straight from Engine.generate."""
    tok = engine.tokenizer
    prefix_ids = tok.encode(prefix)
    scores = []
    for choice in choices:
        ids = tok.encode(prefix + choice)
        start = next(i for i, (a, b) in enumerate(zip(prefix_ids + [-1], ids)) if a != b)
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=start - 1)  # fmt: skip
        values = [v for v, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
        assert len(values) == len(ids) - start
        scores.append(sum(values) / len(values))
    return scores


@pytest.mark.parametrize("prefix", ["Q: Is the sky blue?\nA:", "The answer is "])
def test_select_agrees_with_engine_logprobs(backend, engine, prefix):
    choices = ["yes", "no", " maybe not"]

    @sgl.function
    def pick(s):
        s += prefix + sgl.select("answer", choices)

    state = pick.run(backend=backend)
    expected = _expected_scores(engine, prefix, choices)
    got = state.get_meta_info("answer")["normalized_prompt_logprobs"]
    assert got == pytest.approx(expected, abs=1e-3)
    assert state["answer"] == choices[max(range(3), key=expected.__getitem__)]
    assert state.text() == prefix + state["answer"]


def test_select_scores_the_merged_boundary_token(backend):
    """'The answer is ' ends in a ' ' token that 'yes' merges into (' yes'): the scored span
    starts at that token, so each choice is scored on its own text (SGLang #608)."""
    prefix = "The answer is "

    @sgl.function
    def pick(s):
        s += prefix + sgl.select("answer", ["yes", "no"])

    meta = pick.run(backend=backend).get_meta_info("answer")
    for choice, entries in zip(["yes", "no"], meta["input_token_logprobs"]):
        full = backend.encode(prefix + choice)
        assert [e[1] for e in entries] == full[len(backend.encode(prefix)) - 1 :]
        assert all(e[0] is not None for e in entries)


def test_select_methods(backend):
    choices = ["red", "green apple", "blue"]

    @sgl.function
    def pick(s, method):
        s += "Color:" + sgl.select("c", choices, choices_method=method)

    greedy = pick.run(sgl.greedy_token_selection, backend=backend).get_meta_info("c")
    firsts = [entries[0][0] for entries in greedy["input_token_logprobs"]]
    state = pick.run(sgl.greedy_token_selection, backend=backend)
    assert state["c"] == choices[max(range(3), key=firsts.__getitem__)]
    uncond = pick.run(sgl.unconditional_likelihood_normalized, backend=backend)
    meta = uncond.get_meta_info("c")
    assert uncond["c"] in choices and len(meta["unconditional_token_logprobs"]) == 3
    gains = meta["normalized_unconditional_prompt_logprobs"]
    assert uncond["c"] == choices[max(range(3), key=gains.__getitem__)]


def test_gen_with_choices_is_select(backend):
    @sgl.function
    def pick(s):
        s += "Q: yes or no?\nA:" + sgl.gen("a", choices=[" yes", " no"])
        s += "\nB:" + sgl.select("b", [" yes", " no"])

    state = pick.run(backend=backend)
    assert state["a"] == state["b"]
    assert "normalized_prompt_logprobs" in state.get_meta_info("a")


# ---- errors ------------------------------------------------------------------------------


def test_reading_an_unset_variable_is_a_key_error_naming_it(backend):
    state = complete.run(prompt="Hi", backend=backend)
    with pytest.raises(KeyError, match="missing"):
        state["missing"]


def test_nested_roles_are_a_value_error(backend):
    @sgl.function
    def nested(s):
        with s.user():
            s += sgl.assistant("no")

    with pytest.raises(ValueError, match="nested roles"):
        nested.run(backend=backend)


def test_bad_primitive_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", [])
    with pytest.raises(ValueError, match="choices"):
        sgl.gen("x", choices=[])
    with pytest.raises(TypeError, match="max_length"):
        sgl.gen("x", max_length=3)
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=int, regex="a+")
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)
    with pytest.raises(ValueError, match="temperature"):
        sgl.select("x", ["a", "b"], temperature=0.7)


def test_invalid_sampling_values_are_rejected_by_the_backend(backend):
    with pytest.raises(ValueError, match="top_p"):
        complete.run(prompt="Hi", backend=backend, top_p=5.0)


def test_unreachable_backend_names_the_url():
    with pytest.raises(ConnectionError, match="127.0.0.1:9"):
        RuntimeEndpoint("http://127.0.0.1:9")


def test_no_backend_is_a_clear_error(monkeypatch):
    from radixserve.frontend_lang.global_config import global_config

    monkeypatch.setattr(global_config, "default_backend", None)
    with pytest.raises(ValueError, match="set_default_backend"):
        complete.run(prompt="Hi")


# ---- more gen options --------------------------------------------------------------------


def test_gen_stop_logprobs_and_n_samples(backend, engine):
    direct = engine.generate("Once upon a time", {"max_new_tokens": 8} | GREEDY)
    words = [engine.tokenizer.decode([t]) for t in direct["output_ids"]]
    stop = words[3]

    @sgl.function
    def story(s):
        s += "Once upon a time"
        s += sgl.gen("cut", max_tokens=8, stop=stop, return_logprob=True, **GREEDY)
        s += sgl.gen("many", max_tokens=2, n=2, temperature=1.0, ignore_eos=True)

    state = story.run(backend=backend)
    assert state["cut"] == direct["text"][: direct["text"].index(stop)]
    meta = state.get_meta_info("cut")
    assert meta["finish_reason"]["type"] == "stop"
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert len(state["many"]) == 2 and all(isinstance(t, str) for t in state["many"])
    assert state.text() == "Once upon a time" + state["cut"]  # n > 1 leaves the text alone


def test_var_scope_captures_the_text_of_a_block(backend):
    @sgl.function
    def scoped(s):
        s += "Intro. "
        with s.var_scope("body"):
            s += "Line:" + sgl.gen(max_tokens=2, **GREEDY)

    state = scoped.run(backend=backend)
    assert state.text() == "Intro. " + state["body"] and state["body"].startswith("Line:")


def test_item_assignment_sets_a_variable_as_set_var_does(backend):
    """`s["x"] = v` is SGLang's set_var: it replaces a generated value or adds a new one, in
    the program and in a fork child (which a join then gathers like a generated variable)."""

    @sgl.function
    def annotated(s):
        s += "Hi" + sgl.gen("x", max_tokens=2, **GREEDY)
        raw = s["x"]
        s["x"] = raw.upper()
        s["note"] = {"len": len(raw)}
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f["k"] = i
        forks.join()
        return raw

    state = annotated.run(backend=backend)
    raw = state.ret_value
    assert state["x"] == raw.upper() and state.text() == "Hi" + raw
    assert state.get_meta_info("x")["completion_tokens"] == 2  # the gen's meta info stays
    assert "note" in state and state["note"] == {"len": len(raw)}
    assert state["k"] == [0, 1]
    state["late"] = 1  # after the run, on the returned state
    assert state.get_var("late") == 1


def test_runtime_endpoint_sends_the_api_key_and_reports_http_errors():
    """A stub server: the endpoint sends `Authorization: Bearer <key>`, and an error status
    becomes an exception naming the URL."""
    import http.server

    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            ok = self.path == "/get_model_info"
            body = b'{"model_path": "stub"}' if ok else b'{"error": {"message": "nope"}}'
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        endpoint = RuntimeEndpoint(url, api_key="sekret")
        assert endpoint.model_info == {"model_path": "stub"}
        with pytest.raises(RuntimeError, match=f"{url}/server_info answered 401: nope"):
            endpoint.get_server_info()
        assert seen == ["Bearer sekret", "Bearer sekret"]
    finally:
        httpd.shutdown()


def test_role_markers_of_a_bos_writing_template(engine):
    """A Llama-3-style template (writes bos_token, injects a default system message): the
    program's text is still exactly the template's rendering of its messages."""
    import copy

    from radixserve.frontend_lang import ChatTemplate

    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = (
        "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|start_header_id|>system"
        "<|end_header_id|>\n\nDefault sys<|eot_id|>{% endif %}{% for m in messages %}"
        "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
        "<|eot_id|>{% endfor %}"
    )
    template = ChatTemplate.from_tokenizer(tokenizer)
    assert template.default_system_prompt == "Default sys"
    assert template.first_prefix == tokenizer.bos_token and template.stop_str == ("<|eot_id|>",)

    @sgl.function
    def chat(s):
        s += sgl.user("Hi")
        s += sgl.assistant("Hello")
        s += sgl.system("Late note")

    state = chat.run(backend=EngineBackend(engine, chat_template=template))
    assert state.text() == tokenizer.apply_chat_template(state.messages(), tokenize=False)
