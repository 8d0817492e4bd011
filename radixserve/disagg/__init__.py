"""Prefill/decode disaggregation: KV pages as bytes (`kv_pages.py`), their transfer between
workers keyed by SGLang's bootstrap room (`transfer.py`), and each worker's end of it
(`worker.py`); engine/kv_handoff.py wires them into the scheduler."""
