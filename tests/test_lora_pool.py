"""The LoRA adapter pool: --max-loras-per-batch slots, --max-loaded-loras held adapters,
--lora-eviction-policy, and admission waiting for a slot (with aging) - on test_lora.py's
tiny Llama and PEFT adapters."""

from __future__ import annotations

import pytest
import torch
from test_lora import NUM_NEW, _model_config, lora_models, references  # noqa: F401 (fixtures)

from conftest import greedy, make_core, make_engine, prompt_ids
from radixserve.engine.request import Req, ReqState
from radixserve.model.lora import load_lora_weights
from radixserve.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def pool_engine(lora_models):  # noqa: F811
    """Three adapters (a3: a1's folder again) over a pool of two slots, fifo."""
    base_folder, folders = lora_models
    paths = [f"a1={folders['a1']}", f"a2={folders['a2']}", f"a3={folders['a1']}"]
    engine = make_engine(str(base_folder), lora_paths=paths, max_loras_per_batch=2,
                         max_loaded_loras=4, lora_eviction_policy="fifo")  # fmt: skip
    yield engine
    engine.shutdown()


def test_more_adapters_than_slots_in_one_call(pool_engine, references):  # noqa: F811
    """The base and three adapters asked for at once over two slots: the scheduler runs at
    most two adapters per batch, the pool swaps them, each request gets PEFT's tokens."""
    prompts, out = references
    names = [None, "a1", "a2", "a3"]
    cases = [(name, i) for i in range(len(prompts)) for name in names]
    lora = pool_engine.core.runner.lora
    evictions = lora.evictions
    results = pool_engine.generate(
        input_ids=[prompts[i] for _, i in cases],
        sampling_params=greedy(NUM_NEW),
        lora_path=[name for name, _ in cases],
    )
    for (name, i), result in zip(cases, results):
        expected = out["a1" if name == "a3" else name][i]
        assert result["output_ids"] == expected, (name, i)
    assert lora.evictions > evictions and len(lora.slot_of_id) <= 2
    pool_engine.core.check_integrity()


def test_loading_past_max_loaded_loras_is_refused(pool_engine, lora_models, references):  # noqa: F811
    _, folders = lora_models
    prompts, out = references
    pool_engine.load_lora_adapter("a4", str(folders["a2"]))
    with pytest.raises(ValueError, match=r"'a5': 4 adapters are loaded \(--max-loaded-loras\)"):
        pool_engine.load_lora_adapter("a5", str(folders["a2"]))
    result = pool_engine.generate(input_ids=prompts[0], sampling_params=greedy(NUM_NEW),
                                  lora_path="a4")  # fmt: skip
    assert result["output_ids"] == out["a2"][0]
    pool_engine.unload_lora_adapter("a4")
    assert "a4" not in pool_engine.core.runner.lora.ids


@pytest.mark.parametrize("policy, kept", [("lru", {"a1", "a3"}), ("fifo", {"a2", "a3"})])
def test_eviction_policy(lora_models, policy, kept):  # noqa: F811
    """Pool of two: a1, a2, a1 again, then a3 - lru gives up a2 (least recently used),
    fifo a1 (first in); an adapter in use is never given up."""
    _, folders = lora_models
    adapters = {"a1": str(folders["a1"]), "a2": str(folders["a2"]), "a3": str(folders["a1"])}
    lora = load_lora_weights(_model_config(), adapters, None, torch.float32,
                             torch.device("cpu"), num_slots=2, policy=policy)  # fmt: skip
    ids = lora.ids
    for name in ("a1", "a2", "a1", "a3"):
        lora.activate({ids[name]}, set())
    names = {name for name, load_id in ids.items() if load_id in lora.slot_of_id}
    assert names == kept and lora.evictions == 1
    (left,) = set(ids) - kept
    lora.activate({ids[left]}, in_use={ids["a3"]})  # a3 in use: the other one goes
    assert ids["a3"] in lora.slot_of_id and ids[left] in lora.slot_of_id
    busy = {ids["a3"], ids[left]}
    (other,) = set(ids) - {"a3", left}
    with pytest.raises(RuntimeError, match="2 slots \\(--max-loras-per-batch\\) all in use"):
        lora.activate({ids[other]}, in_use=busy)


def _req(rid: str, lora_id: int, i: int) -> Req:
    return Req(rid, prompt_ids(i, 20), SamplingParams(**greedy(4)), seed=0, lora_id=lora_id)


def test_admission_prefers_the_batch_adapter_and_ages(lora_models):  # noqa: F811
    """One slot: a request of another adapter waits while those of the batch's adapter join
    after it; once bypassed --schedule-max-bypass times nothing more joins until it fits."""
    base_folder, folders = lora_models
    paths = [f"a1={folders['a1']}", f"a2={folders['a2']}"]
    core = make_core(str(base_folder), lora_paths=paths, max_loras_per_batch=1,
                     schedule_policy="fcfs", schedule_max_bypass=2)  # fmt: skip
    ids = core.runner.lora.ids
    admission = core.scheduler.admission
    first, other = _req("x1", ids["a1"], 1), _req("y", ids["a2"], 2)
    later = [_req(f"x{i}", ids["a1"], i) for i in range(3, 6)]
    waiting, running = [first, other, *later], []
    work = admission.admit(waiting, running, budget=4096, leaders=[], retracted=set())
    # x1 joins; y (a2) waits; x3 and x4 (a1) pass it; y is then starved, so x5 waits too
    assert [w.req.rid for w in work] == ["x1", "x3", "x4"]
    assert waiting == [other, later[2]] and other.num_bypassed == 2
    for req in running:  # the a1 requests finished: y goes first, x5 (a1) waits for the slot
        core.scheduler.pages.release(req)
    running.clear()
    work = admission.admit(waiting, running, budget=4096, leaders=[], retracted=set())
    assert [w.req.rid for w in work] == ["y"] and waiting == [later[2]]
    assert later[2].state is ReqState.WAITING
    core.scheduler.pages.release(other)
