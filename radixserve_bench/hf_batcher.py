"""The HF transformers baseline's model side: loading, and a worker thread that runs static
batches, one `model.generate` each, as a user of plain transformers would.

    queue ──> [take up to max_batch_size, waiting batch_wait_s after the first]
          ──> left-pad ──> model.generate(max_new_tokens = the batch's largest) ──> next batch

Requests that arrive while a batch runs wait for the next one: nothing joins mid-batch. A
streamer hands each row's token to its request every decode step, so TTFT and ITL are what
a client of such a server really sees.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from radixserve.config import LoadConfig
from radixserve.model.loader import weights_folder
from radixserve.model.source import resolve_model
from radixserve.model.tokenizer import model_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HFModel:
    """A transformers model with what serving it needs."""

    model: Any  # a PreTrainedModel
    tokenizer: Any
    name: str
    eos_ids: frozenset[int]  # the config's and the tokenizer's, as radixserve's engine uses
    context_length: int

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size


def load_hf_model(model: str | None, dtype: str = "auto", device: str = "auto") -> HFModel:
    """The same weights radixserve loads for `model` (a GGUF through its converted folder)."""
    load = LoadConfig(model=model, dtype=dtype, device=device)
    hf = AutoModelForCausalLM.from_pretrained(weights_folder(model), dtype=load.torch_dtype())
    hf = hf.to(load.torch_device()).eval()
    tokenizer = model_tokenizer(model)
    eos = hf.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    context = hf.config.max_position_embeddings
    return HFModel(hf, tokenizer, resolve_model(model).name, frozenset(eos_ids), context)


class Step(NamedTuple):
    """What a request hears from the worker: a new token, and its finish reason on the last."""

    token: int | None  # None when the request ends without one (aborted)
    finish_reason: dict[str, Any] | None  # SGLang's: {"type": "length" | "stop" | "abort", ...}


@dataclass
class HFRequest:
    """One /generate request. The worker thread sends its Steps to `steps` on `loop`."""

    input_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    steps: asyncio.Queue[Step] = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client left before its batch started
    cached_tokens: int = 0  # prompt tokens served from a cache (continuous batching only)
    num_generated: int = 0  # worker thread only
    finished: bool = False  # worker thread only

    def add_token(self, token: int, eos_ids: frozenset[int]) -> None:
        self.num_generated += 1
        reason = None
        if self.num_generated >= self.max_new_tokens:
            reason = {"type": "length", "length": self.max_new_tokens}
        elif not self.ignore_eos and token in eos_ids:
            reason = {"type": "stop", "matched": token}
        self._send(Step(token, reason))

    def abort(self, message: str) -> None:
        self._send(Step(None, {"type": "abort", "message": message}))

    def _send(self, step: Step) -> None:
        self.finished = step.finish_reason is not None
        self.loop.call_soon_threadsafe(self.steps.put_nowait, step)


class RowStreamer(BaseStreamer):
    """Hands each row's new token to its request; a finished row's later tokens are dropped."""

    def __init__(self, reqs: list[HFRequest], eos_ids: frozenset[int]):
        self.reqs, self.eos_ids = reqs, eos_ids
        self.saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.saw_prompt:  # generate's first put is the padded prompt, [batch, width]
            self.saw_prompt = True
            return
        for req, token in zip(self.reqs, value.tolist()):  # value: [batch], one step's tokens
            if not req.finished:
                req.add_token(token, self.eos_ids)

    def end(self) -> None:
        """Nothing held back: every token was handed over in `put`."""


class RowsDone(StoppingCriteria):
    """A row is done at its own max_new_tokens, or at EOS unless it ignores EOS; every row
    is done once the server stops. generate() ends when all rows are done."""

    def __init__(self, reqs: list[HFRequest], width: int, eos_ids, stopping: threading.Event):
        self.width, self.stopping = width, stopping
        self.max_new = torch.tensor([r.max_new_tokens for r in reqs])
        self.at_eos = torch.tensor([not r.ignore_eos for r in reqs])
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids[:, self.width :].cpu()  # [batch, num_new]; the streamer syncs anyway
        done = self.max_new <= new.shape[1]
        if len(self.eos):
            done |= torch.isin(new, self.eos).any(dim=1) & self.at_eos
        if self.stopping.is_set():
            done[:] = True
        return done.to(input_ids.device)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask, both [batch, longest prompt], padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


class StaticBatcher:
    """The worker thread: takes a batch, runs one generate for it, repeats."""

    def __init__(self, hf: HFModel, max_batch_size: int, batch_wait_s: float):
        self.hf, self.max_batch_size, self.batch_wait_s = hf, max_batch_size, batch_wait_s
        pad = hf.model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else min(hf.eos_ids, default=0)
        self.pending: queue.Queue[HFRequest | None] = queue.Queue()
        self.stopping = threading.Event()
        self.num_batches = self.num_requests = 0  # batches run and the requests in them
        self.thread = threading.Thread(target=self._loop, name="hf-batcher", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, req: HFRequest) -> None:
        self.pending.put(req)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ends the running batch at its next step; every unfinished request is aborted."""
        self.stopping.set()
        self.pending.put(None)
        self.thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            batch = self._next_batch()
            if batch:
                self._run(batch)
        while not self.pending.empty():
            if (req := self.pending.get()) is not None:
                req.abort("the server is shutting down")

    def _next_batch(self) -> list[HFRequest]:
        batch = [self.pending.get()]
        deadline = time.monotonic() + self.batch_wait_s
        while batch[-1] is not None and len(batch) < self.max_batch_size:
            try:
                batch.append(self.pending.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return [r for r in batch if r is not None and not r.cancelled]

    def _run(self, batch: list[HFRequest]) -> None:
        self.num_batches, self.num_requests = self.num_batches + 1, self.num_requests + len(batch)
        ids, mask = left_pad([r.input_ids for r in batch], self.pad_id)
        device = self.hf.model.device
        done = RowsDone(batch, ids.shape[1], self.hf.eos_ids, self.stopping)
        try:
            with torch.inference_mode():
                self.hf.model.generate(
                    ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=max(r.max_new_tokens for r in batch),
                    do_sample=False,
                    eos_token_id=None,  # RowsDone decides per row, ignore_eos included
                    pad_token_id=self.pad_id,
                    stopping_criteria=StoppingCriteriaList([done]),
                    streamer=RowStreamer(batch, self.hf.eos_ids),
                )
            message = "the server is shutting down"
        except Exception as exc:
            logger.exception("generate failed on a batch of %d", len(batch))
            message = f"generation failed: {type(exc).__name__}: {exc}"
        for req in batch:
            if not req.finished:
                req.abort(message)
