"""EAGLE3 tree verification's attention on CPU: cpu_fused's C++ paged_extend with the tree
(`tree_parents`) against the masked SDPA path it replaced (torch_native's gather + SDPA,
what cpu_fused ran for tree requests before), one layer, no model needed.

Per case: `init_forward` once per batch (the metadata both build: parents or masks, page
lists) and one layer's `forward` call, each the min over `--repeats` of the thread's CPU time
(time.thread_time: other processes on a loaded machine do not count). Run with one thread:

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/tree_attention.py
"""

from __future__ import annotations

import argparse
import time

import torch

from radixserve.attention.cpu_fused import CpuFusedBackend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.cache.kv_pool import KVPool, PoolShape
from radixserve.forward_batch import ForwardBatch

# (name, q heads, kv heads, head_dim, requests, cached prefix, tree nodes after the root)
CASES = [
    ("SmolLM2-135M heads, ctx 256, 7 nodes", 9, 3, 64, 1, 256, 7),
    ("SmolLM2-135M heads, ctx 1024, 15 nodes", 9, 3, 64, 1, 1024, 15),
    ("Llama-3.2-1B heads, ctx 1024, 15 nodes, 4 reqs", 32, 8, 64, 4, 1024, 15),
    ("Llama-3.2-1B heads, ctx 4096, 31 nodes", 32, 8, 64, 1, 4096, 31),
]


def tree_parents(nodes: int, topk: int = 4) -> list[int]:
    """An EAGLE-shaped tree: the root's topk children, then topk children per node in turn."""
    return [max(0, (j - 1) // topk) for j in range(1, nodes + 1)]


def cpu_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, 1000 * (time.thread_time() - start))
    return best


def run_case(case: tuple, repeats: int, page_size: int = 16) -> dict[str, float]:
    _, heads, kv_heads, dim, reqs, prefix, nodes = case
    per_req = -(-(prefix + nodes + 1) // page_size)
    pool = KVPool(PoolShape(1, reqs * per_req + 1, page_size, kv_heads, dim), torch.float32, "cpu")
    pool.k.normal_()
    pool.v.normal_()
    tables = [list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i in range(reqs)]
    parents = tree_parents(nodes)
    batch = ForwardBatch.build(
        [[1] * (nodes + 1)] * reqs,
        [prefix] * reqs,
        tables,
        page_size,
        tree_parents=[parents] * reqs,
    )
    q = torch.randn(batch.num_tokens, heads, dim)
    k, v = torch.randn(2, batch.num_tokens, kv_heads, dim)
    row = {}
    for name, backend in (("sdpa", TorchNativeBackend(pool)), ("cpp", CpuFusedBackend(pool))):
        row[f"{name}_init_ms"] = cpu_ms(lambda b=backend: b.init_forward(batch), repeats)
        backend.init_forward(batch)
        row[f"{name}_layer_ms"] = cpu_ms(lambda b=backend: b.forward(q, k, v, 0, batch), repeats)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    print(f"threads={torch.get_num_threads()}; CPU ms (thread time), min of {args.repeats}")
    print(f"{'case':<48}{'SDPA layer':>11}{'C++ layer':>11}{'SDPA init':>11}{'C++ init':>10}")
    for case in CASES:
        r = run_case(case, args.repeats)
        print(
            f"{case[0]:<48}{r['sdpa_layer_ms']:>11.3f}{r['cpp_layer_ms']:>11.3f}"
            f"{r['sdpa_init_ms']:>11.3f}{r['cpp_init_ms']:>10.3f}"
        )


if __name__ == "__main__":
    main()
