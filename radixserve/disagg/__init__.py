"""Prefill/decode disaggregation, the transfer layer: KV pages as bytes (`kv_pages.py`) and
their transfer between workers, keyed by SGLang's bootstrap room (`transfer.py`). Not wired
into the engine yet: the flags (`--disaggregation-mode` ...) come with that step."""
