"""The scheduler: one `step()` = pick work, build a batch, run the model, sample, commit.

Requests join the running batch every step and leave it as soon as they finish. Each step
mixes one decode token for every decoding request with prefill chunks of new or partly
prefilled requests, under a per-step prefill budget. Prompts are matched against the prefix
cache on admission; finished (and retracted) requests give their prompt and output pages to
the tree, so later requests, and the next turn of a chat, hit them.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from radixserve.cache.prefix_cache import PrefixCache
from radixserve.cache.retention import PinTable
from radixserve.config import DisaggregationConfig, SchedulerConfig
from radixserve.distributed.group import RankFailedError
from radixserve.engine.admission import Admission
from radixserve.engine.batch_builder import BatchBuilder, Work, lora_of
from radixserve.engine.commit import Committer
from radixserve.engine.faults import FaultInjector
from radixserve.engine.intake import Intake
from radixserve.engine.jump_forward import JumpForward
from radixserve.engine.kv_handoff import KVHandoff
from radixserve.engine.new_token_ratio import NewTokenRatio
from radixserve.engine.protocol import ABORTED_BY_CLIENT, FinishReason
from radixserve.engine.req_pages import ReqPages
from radixserve.engine.request import Req, ReqState
from radixserve.engine.speculative import Drafter, Speculator, Verifier, create_drafter
from radixserve.engine.stats import EngineStats
from radixserve.engine.token_sampler import TokenSampler
from radixserve.model.runner import LogitsOutput, ModelRunner
from radixserve.sampling.grammar import GrammarBackend, GrammarStats

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: PrefixCache,
        config: SchedulerConfig,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer=None,
        drafter: Drafter | None = None,
        disaggregation: DisaggregationConfig | None = None,
    ):
        """`drafter`: built by the caller for SELF / STANDALONE (a draft model); NGRAM's is
        built here from the config when not given. `disaggregation`: this worker's role in
        prefill/decode disaggregation, if any."""
        config.verify()
        self.runner = runner
        self.pool = runner.pool
        self.cache = cache
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.page_size = runner.pool.page_size
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._grammar: GrammarBackend | None = None
        self.stats = EngineStats()
        max_pinned = int(config.max_pinned_fraction * self.pool.allocator.capacity)
        self.pins = PinTable(cache, max_pinned, max_pins=config.max_pins)
        self.pages = ReqPages(
            self.pool,
            cache,
            self.stats,
            self.pins,
            use_priority=config.enable_priority_scheduling,
            pins_give_way=config.pin_policy == "last",
        )
        self.batches = BatchBuilder(self.page_size, runner.device, lora_of(runner))
        self._retracted: set[Req] = set()  # retracted in this step: they wait for the next
        self.last_step_progressed = True  # see step()
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.admission = Admission(cache, self.pool, self.pages, config, self.stats, self.ratio)
        self.faults = FaultInjector.from_env()
        self.sampler = TokenSampler(
            self.eos_token_ids, tokenizer, lambda: self.grammar, self.faults
        )
        drafter = drafter or create_drafter(config)
        self.speculator = drafter and Speculator(drafter, config, self.stats, runner)
        self.verifier = Verifier(self.sampler.min_tokens_stop_ids, lambda: self.grammar)
        self.handoff = KVHandoff.create(disaggregation, self.pages, self.stats)
        jump_on = not config.disable_jump_forward
        self.jumps = JumpForward(jump_on, tokenizer, self.sampler.check_finish, self.stats)
        self.intake = Intake(self.stats, self.pages, self.jumps, self.handoff, lambda: self.grammar)
        self.intake.lora = self.admission.lora = self.batches.lora
        self.committer = Committer(
            sampler=self.sampler,
            verifier=self.verifier,
            speculator=self.speculator,
            jumps=self.jumps,
            pages=self.pages,
            stats=self.stats,
            faults=self.faults,
        )

    @property
    def drafter(self) -> Drafter | None:
        return None if self.speculator is None else self.speculator.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        """Replaces the drafter (tests, benchmarks); speculation must be on."""
        if drafter is None and self.speculator is None:
            return
        if self.speculator is None:
            raise ValueError("speculation is off: start with --speculative-algorithm")
        self.speculator.drafter = drafter

    @property
    def new_token_ratio(self) -> float:
        return self.ratio.value

    @property
    def inbox(self) -> deque[Req]:
        return self.intake.inbox

    @property
    def compiling(self) -> list[Req]:
        return self.intake.compiling

    @property
    def receiving(self) -> list[Req]:
        return self.intake.receiving

    # ---- queue ---------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Queues a validated request; it joins the batch at the next step."""
        self.inbox.append(req)

    def abort_request(self, request_id: str) -> None:
        """Marks the request; it leaves the queue or the batch at the next step."""
        for req in self.all_reqs():
            if req.request_id == request_id:
                req.abort_requested = True

    def abort_all(self, message: str) -> list[Req]:
        """Ends every request at once (a step failed in a way no request can be blamed for);
        their pages go back to the tree or the allocator. Returns them."""
        reqs = self.all_reqs()
        for req in reqs:
            if req.state is ReqState.RUNNING:
                self._release(req)
            self.pages.release_hold(req)
            req.finish(FinishReason.abort(message, status_code=500))
        self.intake.clear()
        self.waiting, self.running = [], []
        if self.handoff is not None:
            self.handoff.report_aborted(reqs)
        return reqs

    def all_reqs(self) -> list[Req]:
        return [*self.intake.reqs(), *self.waiting, *self.running]

    def has_work(self) -> bool:
        queued = self.inbox or self.receiving or self.compiling or self.waiting
        return bool(queued or self.running)

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake` (thread-safe) is called when work finishes off the core thread and a step
        can use it: a grammar compiled, a disaggregated decode's KV arrived. The core loop
        passes its own."""
        self.intake.wake = wake
        if self.handoff is not None:
            self.handoff.wake = wake

    def close(self) -> None:
        """Stops disaggregation's transfer (its bootstrap port, its fetch threads)."""
        if self.handoff is not None:
            self.handoff.close()

    def grammar_stats(self) -> GrammarStats | None:
        return None if self._grammar is None else self._grammar.stats

    @property
    def grammar(self) -> GrammarBackend:
        """Built on the first constrained request (loading xgrammar costs a second)."""
        if self._grammar is None:
            vocab_size = self.runner.config.vocab_size
            size = self.config.grammar_cache_size
            self._grammar = GrammarBackend(self.tokenizer, vocab_size, self.eos_token_ids, size)
        return self._grammar

    def held_pages(self) -> list[int]:
        """Pages owned by running requests (not by the tree), for integrity checks."""
        return [p for r in self.running for p in r.own_pages()]

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """Runs one batch; returns the requests whose output changed (finished ones included).

        Sets `last_step_progressed`: False when the step ran no forward and changed no
        request (say, only grammar compiles are pending). Stepping again then does nothing
        until something outside changes: a new request, an abort, a compile finishing
        (`pending_compiles()`); a driving loop should wait for one of those, not spin.
        """
        outputs: list[Req] = []
        self.intake.drain(self.waiting, outputs, speculating=self.drafter is not None)
        compiled = self.intake.collect_compiled(self.waiting, outputs)
        received = self.intake.collect_received(self.waiting, outputs)
        self._handle_aborts(outputs)
        work = self._schedule()
        if work:
            try:
                logits = self._forward(work)
            except RankFailedError:  # tensor-parallel ranks out of step: the engine stops
                raise
            except Exception as exc:  # no one request to blame: the step's requests end
                logger.exception("forward failed; aborting the step's %d requests", len(work))
                for w in work:
                    message = f"engine step failed: {type(exc).__name__}: {exc}"
                    self._end_running(w.req, FinishReason.abort(message, status_code=500), outputs)
            else:
                self._commit(work, logits, outputs)
            self.ratio.decay()  # per batch run, as SGLang (idle steps do not count)
        changed = compiled or received or self._retracted
        self.last_step_progressed = bool(work or outputs or changed)
        if self.handoff is not None:
            self.handoff.report_aborted(outputs)
        return outputs

    def pending_compiles(self) -> list[Future]:
        """The grammar compiles that queued constrained requests wait for."""
        return self.intake.pending_compiles()

    def _handle_aborts(self, outputs: list[Req]) -> None:
        for queue in (self.waiting, self.compiling, self.receiving):
            for req in [r for r in queue if r.abort_requested]:
                queue.remove(req)
                self.pages.release_hold(req)
                req.finish(ABORTED_BY_CLIENT)
                outputs.append(req)
        for req in [r for r in self.running if r.abort_requested]:
            self._end_running(req, ABORTED_BY_CLIENT, outputs)

    def _end_running(self, req: Req, reason, outputs: list[Req]) -> None:
        """Takes a running request out of the batch, its pages to the tree or the allocator."""
        if req in self.running:
            self._release(req)
            self.running.remove(req)
        req.finish(reason)
        if req not in outputs:
            outputs.append(req)

    # ---- scheduling ----------------------------------------------------------------------

    def _schedule(self) -> list[Work]:
        self._retracted.clear()
        self.pins.expire()
        decodes, prefilling = self._schedule_decodes()
        chunks = self._schedule_chunks(prefilling)
        while not decodes and not chunks and len(prefilling) > 1:
            # Prefills alone hold the pool and none can grow: nothing would ever progress.
            # Free one's pages (most own pages, youngest on ties) so that the others can.
            self._retract_one()
            prefilling = list(self.running)
            chunks = self._schedule_chunks(prefilling)
        if not decodes and not chunks and prefilling:  # one prefill, stuck: pins give way
            chunks = self._schedule_chunks(prefilling, unpin=True)
        budget = self._prefill_budget() - sum(w.num_new for w in chunks)
        return decodes + chunks + self._admit_waiting(budget, list(prefilling))

    def _schedule_chunks(self, prefilling: list[Req], unpin: bool = False) -> list[Work]:
        """The next chunk of each partly prefilled request, while the budget and pages last
        (`unpin`: retention pins give way if pages are short)."""
        budget = self._prefill_budget()
        chunks: list[Work] = []
        for req in prefilling:
            if budget <= 0:
                break
            num_new = min(req.num_uncomputed, budget)
            if self.pages.grow(req, num_new, unpin):
                chunks.append(Work(req, num_new))
                budget -= num_new
        return chunks

    def _prefill_budget(self) -> int:
        chunk = self.config.chunked_prefill_size
        limit = min(self.config.max_prefill_tokens, self.pages.max_chunk_tokens())
        return limit if chunk < 0 else min(chunk, limit)

    def _schedule_decodes(self) -> tuple[list[Work], list[Req]]:
        """One token for every decoding request; retracts requests if pages run out.

        Also returns the running requests that are still prefilling.
        """
        while True:
            decoding, prefilling = self._split_running()
            needing = [
                r for r in decoding if r.num_computed + 1 > len(r.page_table) * self.page_size
            ]
            if self.pages.ensure_free(len(needing)) or not self._retract_one():
                break
        if needing:  # one allocation; reversed, it hands out what allocate(1) each would
            pages = self.pool.allocator.allocate(len(needing)).tolist()
            for req, page in zip(needing, reversed(pages)):
                req.page_table = req.page_table + [page]
        decodes = [Work(r, 1) for r in decoding]
        if self.speculator is not None:
            speculating = [w for w in decodes if w.req.spec_counts is not None]
            self.speculator.add_drafts(speculating, self.pages.grow_from_free, self._valid_draft)
        return decodes, prefilling

    def _valid_draft(self, req: Req, draft: list[int]) -> list[int]:
        """The draft's prefix that the request's grammar allows (the rest cannot win), cut
        before a token that a jump would follow (the target samples it, then jumps)."""
        return self.jumps.cut_draft(req, self.grammar.valid_draft(req.grammar, draft))

    def _split_running(self) -> tuple[list[Req], list[Req]]:
        """The running requests that decode this step, and those still prefilling."""
        decoding: list[Req] = []
        prefilling: list[Req] = []
        for req in self.running:
            (prefilling if req.is_prefilling else decoding).append(req)
        return decoding, prefilling

    def _admit_waiting(self, budget: int, leaders: list[Req]) -> list[Work]:
        """Admits waiting requests in policy order; `leaders`: requests prefilling already."""
        return self.admission.admit(self.waiting, self.running, budget, leaders, self._retracted)

    # ---- memory pressure -----------------------------------------------------------------

    def _retract_one(self) -> bool:
        """Moves the running request holding the most own pages (the youngest of those;
        the lowest priority first, with priority scheduling) back to the queue; its computed
        full pages stay in the tree."""
        if not self.running:
            return False
        victim = self.admission.retraction_victim(self.running)
        self._release(victim)
        self.running.remove(victim)
        self._retracted.add(victim)
        victim.state = ReqState.WAITING
        victim.num_computed = 0
        victim.num_retractions += 1
        self.waiting.append(victim)
        self.stats.retractions += 1
        self.ratio.reset_after_retraction(self.running)
        logger.info("retracted %s (%d tokens) under memory pressure", victim.rid, victim.seq_len)
        return True

    # ---- forward and commit --------------------------------------------------------------

    def _forward(self, work: list[Work]) -> LogitsOutput:
        self.stats.forward_steps += 1
        if self.faults is not None:
            self.faults.check("forward", (w.req.rid for w in work))
        return self.runner.forward(self.batches.build(work, self.running))

    def _commit(self, work: list[Work], logits: LogitsOutput, outputs: list[Req]) -> None:
        """Each work's results into its request; finished requests leave the batch, and a
        request whose commit fails ends alone (the batch goes on)."""
        if self.speculator is not None:
            self.speculator.on_forward(work, logits)
        tokens = self.committer.sample(work, logits)
        verified = self.committer.verify(work, logits.verify)
        offsets = [0, *itertools.accumulate(w.num_forward for w in work)]
        for i, w in enumerate(work):
            if w.req.finished:  # its sampling or verification failed
                self._end_running(w.req, w.req.finish_reason, outputs)
                continue
            try:
                if w.draft:
                    self.committer.commit_verified(w, *verified[i])
                else:
                    self.committer.commit_sampled(w, tokens.get(i), logits, i, offsets[i])
                if w.req.finished:
                    self._leave_finished(w.req)
            except Exception as exc:  # this request alone fails; the batch goes on
                logger.exception("committing %s failed", w.req.rid)
                message = f"{type(exc).__name__}: {exc}"
                self._end_running(w.req, FinishReason.abort(message, status_code=500), outputs)
                continue
            outputs.append(w.req)

    def _leave_finished(self, req: Req) -> None:
        """A finished request's pages to the tree (on a prefill worker, its prompt's pages
        published first); its sequence to the drafter's store."""
        if self.handoff is not None:
            self.handoff.on_finished(req)
        self._release(req, finished=not req.finish_reason.is_abort)
        self.pages.retain(req)
        self.running.remove(req)

    def _release(self, req: Req, finished: bool = False) -> None:
        """A request leaves the batch: its pages to the tree or the allocator, and what the
        drafter held for it freed (a finished one teaches the drafter first)."""
        if self.speculator is not None:
            self.speculator.on_left(req, finished)
        self.pages.release(req)
