"""`radixserve bench`: agent-shaped serving workloads, load generation, metrics and reports.

A tool beside the runtime, not part of it: it imports radixserve; radixserve imports it only
in `radixserve bench` (radixserve/cli.py hands it everything after `bench`), so `serve` never
loads it.

workloads.py  seeded request graphs (shared-prefix, multi-turn, agent, fork)
hit_rate.py   the theoretical maximum prefix-cache hit rate of a workload
client.py     online load against a server URL (radixserve, sglang, openai backends)
offline.py    the same requests through `radixserve.Engine` in-process
metrics.py    vLLM / SGLang benchmark metrics from per-request timings
report.py     stdout table, JSON with the environment, PNG plots
cli.py        the `radixserve bench` parser and main; modes `serve|offline`
"""
