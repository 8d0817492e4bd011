"""`radixserve bench`: agent-shaped serving workloads, load generation, metrics and reports.

workloads.py  seeded request graphs (shared-prefix, multi-turn, agent, fork)
hit_rate.py   the theoretical maximum prefix-cache hit rate of a workload
client.py     online load against a server URL (radixserve, sglang, openai backends)
offline.py    the same requests through `radixserve.Engine` in-process
metrics.py    vLLM / SGLang benchmark metrics from per-request timings
report.py     stdout table, JSON with the environment, PNG plots
cli.py        `radixserve bench serve|offline`
"""
