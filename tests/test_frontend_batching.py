"""The frontend compiled onto the batching engine: fork children hit the parent's cached
prefix, run_batch computes the shared prefix once with all programs in flight together,
and concurrent calls from many threads land in one scheduler batch."""

from __future__ import annotations

import threading

import pytest

import radixserve.frontend_lang as sgl
from conftest import make_engine
from radixserve.frontend_lang import EngineBackend

GREEDY = {"temperature": 0, "ignore_eos": True}
PREAMBLE = "You are a careful assistant who answers in one short sentence. " * 6
PAGE = 16


@pytest.fixture
def engine(tiny_chat_model):
    """A fresh engine per test, so cache counters start at zero."""
    engine = make_engine(tiny_chat_model)
    yield engine
    engine.shutdown()


class CountingBackend(EngineBackend):
    """Records how many requests were in flight at once."""

    def __init__(self, engine):
        super().__init__(engine)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.payloads: list[dict] = []

    def request(self, payload):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.payloads.append(payload)
        try:
            return super().request(payload)
        finally:
            with self.lock:
                self.in_flight -= 1


# ---- fork --------------------------------------------------------------------------------


@sgl.function
def tips(s, topic):
    s += PREAMBLE + "Topic: " + topic + "\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=3, **GREEDY)
    metas = [f.get_meta_info("tip") for f in forks]
    forks.join()
    s += "Summary:" + sgl.gen("summary", max_tokens=2, **GREEDY)
    return metas


def test_fork_children_hit_the_cached_parent_prefix(backend):
    state = tips.run("tea", backend=backend)
    parent_len = len(backend.encode(PREAMBLE + "Topic: tea\n"))
    for meta in state.ret_value:
        assert meta["cached_tokens"] >= parent_len // PAGE * PAGE > 0
    assert len(state["tip"]) == 3 and all(isinstance(t, str) for t in state["tip"])
    assert state.text().endswith("Summary:" + state["summary"])


def test_fork_commits_the_prefix_once_then_runs_children_together(engine):
    backend = CountingBackend(engine)
    tips.run("coffee", backend=backend)
    commits = [p for p in backend.payloads if p["sampling_params"] == {"max_new_tokens": 0}]
    assert len(commits) == 1 and commits[0]["text"] == PREAMBLE + "Topic: coffee\n"
    assert backend.max_in_flight >= 2  # the children's gens overlapped


def test_fork_lambda_join_modes_and_copy(backend):
    @sgl.function
    def branches(s):
        s += "Start."
        forks = s.fork(2)
        forks += lambda i: f" branch{i}" + sgl.gen("x", max_tokens=2, **GREEDY)
        texts = [f.text() for f in forks]
        forks.join("concate_and_append")
        with s.copy() as c:
            c += " copy" + sgl.gen("y", max_tokens=1, **GREEDY)
        return texts

    state = branches.run(backend=backend)
    first, second = state.ret_value
    assert first.startswith("Start. branch0") and second.startswith("Start. branch1")
    assert state.text() == "Start." + first[len("Start.") :] + second[len("Start.") :]
    assert isinstance(state["y"], list) and len(state["y"]) == 1


@sgl.function
def parallel_encoding(s):
    """Encode two documents in parallel from a shared preamble, then answer over both."""
    s += PREAMBLE
    forks = s.fork(2)
    forks += lambda i: f"Document {i}: " + sgl.gen("doc", max_tokens=4, **GREEDY) + "\n"
    fork_texts = [f.text() for f in forks]
    forks.join(mode="concate_and_append")
    s += "Answer:" + sgl.gen("answer", max_tokens=4, **GREEDY)
    return fork_texts


def test_parallel_encoding_answers_over_the_exactly_joined_text(backend):
    """concate_and_append joins the forks' texts; the answer is the plain greedy continuation
    of the joined text (exact, not spliced KV), served from the cached preamble."""
    state = parallel_encoding.run(backend=backend)
    joined = PREAMBLE + "".join(t[len(PREAMBLE) :] for t in state.ret_value) + "Answer:"
    assert state.text() == joined + state["answer"]
    params = {"max_new_tokens": 4} | GREEDY
    assert state["answer"] == backend.generate(joined, params, {})["text"]
    cached = state.get_meta_info("answer")["cached_tokens"]
    assert cached >= len(backend.encode(PREAMBLE)) // PAGE * PAGE > 0


def test_gather_replaces_a_name_reused_across_fork_levels(engine):
    @sgl.function
    def two_levels(s):
        s += "Root."
        for level in range(2):
            forks = s.fork(2)
            forks += lambda i, level=level: (
                f" L{level}b{i}" + sgl.gen("step", max_tokens=2, **GREEDY)
            )
            expected = [f["step"] for f in forks]
            forks.join()
            assert s["step"] == expected  # the second level's values, not the first's
            s += " next"
        return expected

    state = two_levels.run(backend=EngineBackend(engine))
    assert len(state["step"]) == 2 and state["step"] == state.ret_value
    assert len(state.get_meta_info("step")) == 2  # per-child meta info survives the gather


# ---- run_batch ---------------------------------------------------------------------------


@sgl.function
def answer(s, question):
    s += PREAMBLE + "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=2, **GREEDY)


def test_run_batch_computes_the_shared_prefix_once(engine):
    backend = CountingBackend(engine)
    questions = [f"what is item number {i}?" for i in range(16)]
    states = answer.run_batch([{"question": q} for q in questions], backend=backend)
    stats = engine.get_stats()
    shared = len(engine.tokenizer.encode(PREAMBLE + "Question:"))
    suffix_tokens = sum(len(engine.tokenizer.encode(PREAMBLE + "Question: " + q + "\nAnswer:"))
                        - shared for q in questions)  # fmt: skip
    # the shared prefix once, then per program at most its last partial page and its suffix
    assert stats["prefill_tokens_computed"] <= shared + suffix_tokens + 16 * PAGE
    assert stats["cached_tokens"] >= 16 * (shared // PAGE * PAGE)
    assert backend.payloads[0]["sampling_params"] == {"max_new_tokens": 0}  # the warm-up
    assert backend.max_in_flight >= 4
    assert [s["answer"] for s in states] == [
        engine.generate(PREAMBLE + "Question: " + q + "\nAnswer:", {"max_new_tokens": 2} | GREEDY)[
            "text"
        ]
        for q in questions
    ]


def test_run_batch_on_the_server_reports_cache_hits(endpoint):
    questions = [f"server question {i}?" for i in range(8)]
    before = endpoint.get_server_info()["stats"]
    states = answer.run_batch([{"question": q} for q in questions], backend=endpoint)
    after = endpoint.get_server_info()["stats"]
    shared = len(endpoint.encode(PREAMBLE + "Question:"))
    assert all(s.get_meta_info("answer")["cached_tokens"] >= shared // PAGE * PAGE for s in states)
    assert after["num_requests"] - before["num_requests"] == 9  # 8 programs + one warm-up


def test_run_batch_options_progress_bar_and_generator_style(engine):
    backend = EngineBackend(engine)
    batch = [{"question": f"q{i}"} for i in range(3)]
    listed = answer.run_batch(batch, backend=backend, num_threads=2, progress_bar=True)
    streamed = list(answer.run_batch(batch, backend=backend, generator_style=True))
    assert [s["answer"] for s in listed] == [s["answer"] for s in streamed]
    with pytest.raises(TypeError, match="bogus"):
        answer.run_batch(batch, backend=backend, bogus=1)
    with pytest.raises(ValueError, match="num_threads"):
        answer.run_batch(batch, backend=backend, num_threads=0)


# ---- the engine batches concurrent callers -----------------------------------------------


def test_concurrent_programs_share_scheduler_steps(engine):
    """Eight programs of eight decode steps each, run from eight threads: if their requests
    did not share batches this would take at least 64 forward steps."""

    @sgl.function
    def long_gen(s, i):
        s += f"Story {i}:" + sgl.gen("story", max_tokens=8, **GREEDY)

    states = long_gen.run_batch([{"i": i} for i in range(8)], backend=EngineBackend(engine))
    assert all(s.get_meta_info("story")["completion_tokens"] == 8 for s in states)
    assert engine.get_stats()["forward_steps"] < 32
