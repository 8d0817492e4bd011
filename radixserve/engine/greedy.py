"""A static-batch greedy generator over the paged pool: the runner's simplest driver.

The cache-aware scheduler (continuous batching, radix cache) is the product's real driver;
this one exists for the CLI's first job, for benchmarks and for exactness tests.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.forward_batch import ForwardBatch
from radixserve.model.runner import ModelRunner


def greedy_generate(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Prefills all prompts in one batch, then decodes them together; returns new token ids."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    pool = runner.pool
    tables: list[list[int]] = [[] for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    lens = [0] * len(prompts)
    active = list(range(len(prompts)))
    new_tokens = {i: list(p) for i, p in enumerate(prompts)}
    try:
        while active:
            for i in active:
                tables[i] = pool.extend_page_table(tables[i], lens[i] + len(new_tokens[i]))
            batch = ForwardBatch.build(
                [new_tokens[i] for i in active],
                [lens[i] for i in active],
                [tables[i] for i in active],
                pool.page_size,
                runner.device,
            )
            next_ids = runner.forward(batch).last.argmax(dim=-1).tolist()
            still_active = []
            for i, token in zip(active, next_ids):
                lens[i] += len(new_tokens[i])
                outputs[i].append(token)
                new_tokens[i] = [token]
                if len(outputs[i]) < max_new_tokens and token not in stop_token_ids:
                    still_active.append(i)
            active = still_active
    finally:
        for table in tables:
            pool.allocator.free(table)
    return outputs
