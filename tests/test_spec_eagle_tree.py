"""EAGLE3 tree drafting (--speculative-eagle-topk > 1): the tree mask of the verify forward
equals each path computed as a plain sequence; greedy outputs identical to plain decoding
cold, warm, under retraction and in a mixed batch with stops and a grammar; tree rejection
sampling emits tokens distributed as the target's p; bad flags fail at start."""

from __future__ import annotations

import pytest
import torch
from speculative_common import CHI2_999, chi_square
from test_spec_eagle import _echo_head, _random_head, _save_target

from conftest import VOCAB, greedy, make_engine, prompt_ids, save_tiny_model
from radixserve.config import CacheConfig, LoadConfig
from radixserve.engine.request import Req
from radixserve.engine.speculative import Draft, Verifier
from radixserve.engine.speculative.tree_verify import verify_trees
from radixserve.forward_batch import ForwardBatch
from radixserve.model.runner import ModelRunner
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import SamplingBatch, scale_and_filter


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle_tree")
    return {
        "target": _save_target(root / "target"),
        "random": _random_head(root / "random"),
        "echo": _echo_head(root / "echo"),
    }


def _tree(path: str, topk: int, nodes: int, **extra) -> dict:
    flags = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": path}
    flags |= {"speculative_eagle_topk": topk, "speculative_num_draft_tokens": nodes}
    return flags | {"speculative_num_steps": 3, "speculative_adaptive_threshold": 0} | extra


def _ids(outputs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


PROMPTS = [prompt_ids(i, 20 + 11 * i) for i in range(4)]


@pytest.fixture(scope="module")
def plain(models):
    return make_engine(models["target"])


@pytest.fixture(scope="module")
def expected(plain) -> list[list[int]]:
    return _ids(plain.generate(input_ids=PROMPTS, sampling_params=greedy(30)))


# ---- the tree mask ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch_native", "cpu_fused", "deterministic"])
@torch.inference_mode()
def test_tree_rows_equal_each_path_computed_as_a_sequence(models, backend):
    """A verify forward of a 6-node tree beside a plain decode: each node's logits equal
    the last logits of its root-to-node path extended as a plain sequence - bit for bit
    under --enable-deterministic-inference (cpu_fused's paged_extend with the tree)."""
    deterministic = backend == "deterministic"
    runner = ModelRunner.create(
        LoadConfig(model=models["target"], device="cpu",
                   enable_deterministic_inference=deterministic),
        CacheConfig(page_size=16, max_total_tokens=1024,
                    attention_backend="cpu_fused" if deterministic else backend),
    )  # fmt: skip
    assert getattr(runner.attn, "deterministic", False) == deterministic
    size, prompt = runner.pool.page_size, prompt_ids(2, 21)
    tokens, parents = [11, 12, 13, 14, 15, 16], [0, 0, 1, 1, 2, 4]
    pages = runner.pool.allocator.allocate(4).tolist()
    other = runner.pool.allocator.allocate(2).tolist()
    runner.forward(ForwardBatch.build([prompt[:-1], prompt[:9]], [0, 0], [pages, other], size))
    batch = ForwardBatch.build(
        [[prompt[-1], *tokens], [prompt[9]]], [20, 9], [pages, other], size,
        verify_indices=range(7), tree_parents=[parents, None],
    )  # fmt: skip
    rows = runner.forward(batch).verify
    paths = {0: []}
    for j, (token, parent) in enumerate(zip(tokens, parents), start=1):
        paths[j] = paths[parent] + [token]
    scratch = runner.pool.allocator.allocate(4).tolist()
    for node, path in paths.items():
        runner.forward(ForwardBatch.build([prompt[:-1]], [0], [scratch], size))
        seq = ForwardBatch.build([[prompt[-1], *path]], [20], [scratch], size)
        want = runner.forward(seq).last[0]
        if deterministic:
            assert torch.equal(rows[node], want), node
        else:
            torch.testing.assert_close(rows[node], want, rtol=1e-4, atol=1e-4)


# ---- end to end ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head", "topk", "nodes", "backend"),
    [("random", 2, 6, "torch_native"), ("echo", 4, 10, "auto")],
)
def test_tree_drafting_keeps_greedy_outputs_cold_and_warm(
    models, expected, head, topk, nodes, backend
):
    spec = make_engine(models["target"], attention_backend=backend,
                       **_tree(models[head], topk, nodes))  # fmt: skip
    drafter = spec.scheduler.drafter
    trees = []
    propose_all = drafter.propose_all

    def recording(reqs, max_tokens=None):
        drafts = propose_all(reqs, max_tokens)
        depth = drafter.num_draft_tokens
        limits = max_tokens or [depth] * len(reqs)
        # full depth where a request keeps it (its last tokens draft shallower trees)
        trees.extend(d for d, m in zip(drafts, limits) if d.tokens and m >= depth)
        return drafts

    drafter.propose_all = recording
    pool, moves = spec.runner.pool, []
    copy_slots = pool.copy_slots
    pool.copy_slots = lambda src, dst: (moves.append(len(src)), copy_slots(src, dst))
    initial_free = spec.runner.pool.allocator.num_free
    cold = spec.generate(input_ids=PROMPTS, sampling_params=greedy(30))
    warm = spec.generate(input_ids=PROMPTS, sampling_params=greedy(30))
    assert _ids(cold) == _ids(warm) == expected
    assert trees and all(len(t.tokens) == nodes - 1 for t in trees)
    assert all(len(set(t.parents)) < len(t.parents) for t in trees)  # branching trees
    stats = spec.get_stats()
    if head == "echo":  # accepted paths off the first branch: K/V moved to their positions
        assert stats["spec_accepted_tokens"] > 0 and moves
    spec.check_integrity()
    assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free


def test_trees_on_a_hybrid_sliding_window_model(tmp_path):
    """Gemma 3 (two sliding layers, window 12, and a global one) over the hybrid pool: the
    per-layer backends mask the tree with each window along its paths; accepted nodes' K/V
    move in both page spaces. Greedy outputs equal plain decoding cold and warm, prompts
    longer than the window."""
    target = str(save_tiny_model("gemma3", tmp_path / "gemma3", vocab_size=VOCAB))
    head = _echo_head(tmp_path / "echo", num_layers=3)
    expected = _ids(make_engine(target).generate(input_ids=PROMPTS, sampling_params=greedy(30)))
    spec = make_engine(target, **_tree(head, 2, 6))
    assert type(spec.runner.attn).__name__ == "LayerWindowBackend"
    assert spec.runner.pool.sliding_window == 12  # the hybrid pool: a sliding page space
    pool, moves = spec.runner.pool, []
    copy_slots = pool.copy_slots
    pool.copy_slots = lambda src, dst: (moves.append(len(src)), copy_slots(src, dst))
    initial_free = pool.allocator.num_free
    cold = spec.generate(input_ids=PROMPTS, sampling_params=greedy(30))
    warm = spec.generate(input_ids=PROMPTS, sampling_params=greedy(30))
    assert _ids(cold) == _ids(warm) == expected
    assert spec.get_stats()["spec_accepted_tokens"] > 0 and moves
    spec.check_integrity()
    assert spec.flush_cache() and pool.allocator.num_free == initial_free


@torch.inference_mode()
def _reference_topk(head, states, seq: list[int], path: list[int], topk: int) -> set[int]:
    """The head's top-k after `seq` + `path`, recomputed from scratch as a chain forced
    along `path` (every column causal, no kept K/V, no tree mask, no batch)."""
    aux = torch.cat([states[2][0], states[2][0], states[1][0]], dim=-1)[: len(seq) - 1]
    hidden, tokens = head.fuse(aux)[None], torch.tensor([seq[1:]])
    for forced in [*path, None]:
        width = tokens.shape[1]
        mask = torch.ones(width, width, dtype=torch.bool).tril()[None, None]
        step = head(hidden, tokens, torch.arange(width)[None], None, mask)
        if forced is None:
            return set(step.logits[0].topk(topk).indices.tolist())
        hidden = torch.cat([hidden, step.hidden[:, -1:]], dim=1)
        tokens = torch.cat([tokens, torch.tensor([[forced]])], dim=1)


def test_tree_nodes_are_the_heads_top_k_along_their_paths(models):
    """Every node of a proposed tree (kept K/V, tree-masked draft steps at root + depth,
    a batch of two) is among the head's top-k after its parent's path recomputed from
    scratch."""
    from conftest import hf_model

    spec = make_engine(models["target"], **_tree(models["random"], 3, 8))
    drafter = spec.scheduler.drafter
    proposals = []
    propose_all = drafter.propose_all

    def recording(reqs, max_tokens=None):
        drafts = propose_all(reqs, max_tokens)
        proposals.extend((r.seq_ids(), d) for r, d in zip(reqs, drafts) if d.tokens)
        return drafts

    drafter.propose_all = recording
    spec.generate(input_ids=[prompt_ids(0, 20), prompt_ids(1, 31)], sampling_params=greedy(8))
    target = hf_model(models["target"])
    assert len(proposals) >= 8
    for seq, tree in proposals[:8]:
        states = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        paths = [[], *tree.paths()]
        for token, parent in zip(tree.tokens, tree.parents):
            assert token in _reference_topk(drafter.head, states, seq, paths[parent], 3)


def test_tree_drafting_under_deterministic_inference_keeps_plain_tokens(models):
    """--enable-deterministic-inference with tree drafting (once refused): the plain
    deterministic engine's tokens in a batch, drafts accepted."""
    flags = {"enable_deterministic_inference": True}
    with make_engine(models["target"], **flags) as plain:
        want = _ids(plain.generate(input_ids=PROMPTS, sampling_params=greedy(30)))
    with make_engine(models["target"], **flags, **_tree(models["echo"], 3, 8)) as spec:
        assert spec.runner.attn.deterministic
        assert _ids(spec.generate(input_ids=PROMPTS, sampling_params=greedy(30))) == want
        assert spec.get_stats()["spec_accepted_tokens"] > 0


def test_tiny_pool_retracts_requests_drafting_trees(models, plain):
    prompts = [prompt_ids(i, 24) for i in range(8)]
    reference = _ids(plain.generate(input_ids=prompts, sampling_params=greedy(48)))
    small = make_engine(
        models["target"],
        max_total_tokens=256,
        chunked_prefill_size=64,
        schedule_conservativeness=0.1,
        **_tree(models["echo"], 3, 8),
    )
    assert _ids(small.generate(input_ids=prompts, sampling_params=greedy(48))) == reference
    stats = small.get_stats()
    assert stats["retractions"] > 0 and stats["spec_accepted_tokens"] > 0
    small.check_integrity()


@pytest.fixture(scope="module")
def spec(models):
    return make_engine(models["target"], **_tree(models["echo"], 2, 6))


def test_trees_in_a_mixed_batch_with_stops_grammar_and_sampling(spec, plain):
    """Greedy requests beside a sampled one keep plain decoding's tokens; stop tokens, stop
    strings, max_new_tokens and a grammar end them exactly as plain decoding does; a
    sampled request is reproducible by seed."""
    prompt = prompt_ids(3, 40)
    reference = plain.generate(input_ids=prompt, sampling_params=greedy(40))["output_ids"]
    stop_text = plain.tokenizer.decode(reference[20:22])
    sampled = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 30, "sampling_seed": 3}
    cases = [
        greedy(11),
        greedy(40, stop_token_ids=[reference[17]], ignore_eos=False),
        greedy(40, stop=[stop_text]),
        greedy(12, regex="(ab|a)+"),
    ]
    want = plain.generate(input_ids=[prompt] * 4, sampling_params=cases)
    outputs = spec.generate(
        input_ids=[prompt] * 4 + [prompt_ids(5, 30)], sampling_params=[*cases, sampled]
    )
    for out, ref in zip(outputs, want):
        assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert len(outputs[4]["output_ids"]) == 30
    assert outputs[4]["meta_info"]["spec_draft_token_num"] > 0
    assert spec.flush_cache()
    again = spec.generate(input_ids=prompt_ids(5, 30), sampling_params=sampled)
    assert again["output_ids"] == outputs[4]["output_ids"]
    spec.check_integrity()


def test_a_grammar_prunes_tree_paths_and_masks_each_node_along_its_path(spec):
    """The speculator keeps the nodes whose path the grammar allows; the verifier masks
    each node's row with the grammar advanced over its own path: a forbidden child the
    unmasked logits prefer is never accepted."""
    backend, tokenizer = spec.scheduler.grammar, spec.tokenizer
    matcher = backend.matcher(backend.compile_async("regex", "hello world").result())
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    bang = tokenizer.encode("!", add_special_tokens=False)[0]
    assert len(ids) >= 2 and bang not in ids
    tree = Draft([bang, ids[0], ids[1], bang], None, [0, 0, 2, 2])  # root: !, h; h: w, !
    allowed = [len(backend.valid_draft(matcher, p)) == len(p) for p in tree.paths()]
    kept = tree.keep(allowed)
    assert (kept.tokens, kept.parents) == ([ids[0], ids[1]], [0, 1])
    req = Req("g", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8), seed=0)
    req.grammar = matcher
    logits = torch.zeros(len(kept.tokens) + 1, spec.runner.config.vocab_size)
    logits[:, bang] = 5.0  # unmasked, greedy would emit "!" at the root
    logits[0, ids[0]] = logits[1, ids[1]] = 1.0  # masked: the path's tokens
    verifier = Verifier(lambda r: [], grammar=lambda: backend)
    (result,) = verifier.verify([req], [kept.tokens], logits, None, [kept.parents])
    assert result.path == [1, 2] and result.tokens[:2] == ids[:2] and bang not in result.tokens
    assert matcher.accept_token(ids[0])  # the matcher is back where it started


def test_bad_tree_flags_fail_at_start_naming_the_flag(models):
    with pytest.raises(ValueError, match="speculative_num_draft_tokens must be between 2 and 11"):
        make_engine(models["target"], **_tree(models["random"], 2, 12))  # 1 + 2 + 2 * 4
    with pytest.raises(ValueError, match="speculative_num_draft_tokens must be between 2 and"):
        make_engine(models["target"], **_tree(models["random"], 2, 1, speculative_num_steps=1))
    with pytest.raises(ValueError, match="speculative_eagle_topk must be >= 1"):
        make_engine(models["target"], **_tree(models["random"], 0, 4))


# ---- tree rejection sampling's distribution ----------------------------------------------------

TREE_TOKENS, TREE_PARENTS = [0, 3, 5, 2, 7], [0, 0, 0, 1, 1]  # root: 0, 3, 5; node 1: 2, 7
TREE_ROWS = (  # one row per node, vocab 10
    [3.0, 2.5, 2.0, 1.6, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0],
    [0.3, -1.2, 2.2, 0.1, 1.4, -0.4, 1.9, 0.7, -2.0, 1.1],
    [0.0] * 10,
    [1.0] * 10,
    [2.0, 0.0, 1.0, 0.0, -1.0, 0.0, 1.0, 0.0, 2.0, 0.0],
    [0.5] * 10,
)


def _verify_tree_many(params: SamplingParams, num: int = 6000):
    reqs = [Req(f"r{i}", [1, 2, 3], params, seed=i) for i in range(num)]
    rows = torch.tensor(TREE_ROWS)
    results = verify_trees(
        reqs, [TREE_TOKENS] * num, [TREE_PARENTS] * num, rows.repeat(num, 1), lambda r: []
    )
    batch = SamplingBatch.build([params] * 2, [0, 0], [[], [0]], [[1, 2, 3]] * 2, [[], []], 10)
    return results, scale_and_filter(rows[:2], batch, slice(None)).softmax(dim=-1)


def test_tree_rejection_sampling_emits_the_target_distribution():
    """The first token (through three children of the root) and the token after an
    accepted first child (through its two children) both follow p after temperature and
    top-p; accepted paths are the tree's."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)
    results, target = _verify_tree_many(params)
    first = [r.tokens[0] for r in results]
    stat, dof = chi_square(first, target[0])
    assert stat < CHI2_999[dof], (stat, dof)
    second = [r.tokens[1] for r in results if r.path[:1] == [1]]
    assert len(second) == first.count(0) > 300
    stat, dof = chi_square(second, target[1])
    assert stat < CHI2_999[dof], (stat, dof)
    assert {tuple(r.path) for r in results} <= {(), (1,), (2,), (3,), (1, 4), (1, 5)}


def test_tree_greedy_follows_the_argmax_path():
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    (result,) = verify_trees(
        [Req("g", [1, 2, 3], params, seed=0)], [TREE_TOKENS], [TREE_PARENTS],
        torch.tensor(TREE_ROWS), lambda r: [],
    )  # fmt: skip
    # root argmax 0 -> node 1; its argmax 2 -> node 4 (a leaf); node 4's argmax 0: the bonus
    assert (result.tokens, result.path, result.num_accepted) == ([0, 2, 0], [1, 4], 2)


def test_cutting_a_tree_keeps_the_nodes_up_to_a_depth():
    draft = Draft([10, 11, 12, 13, 14], None, [0, 0, 1, 3, 2])
    cut = draft.cut(2)
    assert (cut.tokens, cut.parents) == ([10, 11, 12, 14], [0, 0, 1, 2])
