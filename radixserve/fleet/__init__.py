"""`radixserve fleet`: data-parallel `radixserve serve` workers behind sglang-router.

Routing, health checks, retries and circuit breaking belong to sglang-router (an optional
extra, `pip install 'radixserve[fleet]'`); this package only starts the processes, pins each
worker to its cores or GPU, waits until all are healthy and stops them together.
"""
