"""Training what the runtime serves: `radixserve train-eagle` (EAGLE-3 draft heads)."""
