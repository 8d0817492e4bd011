"""The engine core: core loop and process, scheduler, admission, commit, speculative decoding;
the typed messages (`protocol.py`) and their wire format (`wire.py`) that callers speak."""
