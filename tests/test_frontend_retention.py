"""The DSL passes priority, session_id and retention per gen or per run, on both backends."""

from __future__ import annotations

from radixserve.frontend_lang import assistant, function, gen, system, user


@function
def turn(s, question):
    s += system("You are a terse agent.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=4, temperature=0))


def _num_pins(backend) -> int:
    return backend.get_server_info()["stats"]["num_pins"]


def test_a_run_with_retention_pins_its_session(backend):
    before = _num_pins(backend)
    state = turn.run("hello?", backend=backend, session_id="dsl-s", retention={"ttl_s": 30})
    assert state["answer"] is not None
    assert _num_pins(backend) == before + 1
    # the next call of the session ends the pin; it asks for none itself
    turn.run("and then?", backend=backend, session_id="dsl-s")
    assert _num_pins(backend) == before


@function
def pinned_gen(s):
    s += "Tool catalogue: search(query), fetch(url), run(code), ask(user). " * 3  # > 1 page
    s += gen("a", max_tokens=2, temperature=0, session_id="dsl-g", retention={"ttl_s": 30})


def test_a_gen_with_retention_pins_and_priority_zero_passes(backend):
    before = _num_pins(backend)
    pinned_gen.run(backend=backend, priority=0)
    assert _num_pins(backend) == before + 1
    turn.run("done", backend=backend, session_id="dsl-g")  # ends it
    assert _num_pins(backend) == before
