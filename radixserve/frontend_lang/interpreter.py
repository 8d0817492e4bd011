"""Running programs: one (`run_program`) or many at once (`run_program_batch`).

A program runs eagerly in the calling thread; streamed ones on a worker thread. A batch
runs each program on its own pool thread, so all their requests are in flight together
and the engine batches them, after the prefix every input shares has been cached once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from radixserve.frontend_lang.backends import Backend
from radixserve.frontend_lang.executor import Executor
from radixserve.frontend_lang.global_config import global_config
from radixserve.frontend_lang.sampling import GenParams
from radixserve.frontend_lang.state import ProgramState
from radixserve.frontend_lang.tracing import precache_shared_prefix


def run_program(func: Callable, backend: Backend, args: tuple, kwargs: dict,
                defaults: GenParams, stream: bool = False) -> ProgramState:  # fmt: skip
    """Runs `func(s, *args, **kwargs)`; with stream=True returns at once (see text_iter)."""
    executor = Executor(backend, defaults, stream=stream, worker=stream)
    state = ProgramState(executor)

    def body() -> None:
        try:
            state.ret_value = func(state, *args, **kwargs)
        finally:
            executor.finish()
        if global_config.verbosity >= 2:
            print(state.text())

    executor.run_task(body)
    return state


def run_program_batch(
    func: Callable,
    backend: Backend,
    batch_kwargs: list[dict],
    defaults: GenParams,
    num_threads: int | str = "auto",
    progress_bar: bool = False,
    generator_style: bool = False,
) -> list[ProgramState] | Iterator[ProgramState]:
    """Runs one program per kwargs dict, concurrently; results in input order."""
    if global_config.enable_precache_with_tracing:
        precache_shared_prefix(func, backend, batch_kwargs, defaults)
    pool = ThreadPoolExecutor(resolve_num_threads(num_threads, len(batch_kwargs)))
    futures = [pool.submit(run_program, func, backend, (), kw, defaults) for kw in batch_kwargs]
    results = _collect(futures, pool, progress_bar)
    return results if generator_style else list(results)


def _collect(futures: list[Future], pool: ThreadPoolExecutor, progress_bar: bool):
    bar = _progress(len(futures)) if progress_bar else None
    try:
        for future in futures:
            yield future.result()
            if bar is not None:
                bar.update(1)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if bar is not None:
            bar.close()


def resolve_num_threads(num_threads: int | str, batch_size: int) -> int:
    """ "auto" is SGLang's max(96, 16 x CPUs), capped at the batch size."""
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or an int >= 1; got {num_threads!r}")
    return max(1, min(num_threads, batch_size))


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="run_batch", unit="program")
