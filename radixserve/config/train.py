"""TrainEagleConfig: the options of `radixserve train-eagle` (train/eagle3_trainer.py)."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.field_types import flag_of


@dataclass
class TrainEagleConfig:
    output: str = "eagle3-head"
    """folder the head is written to (created)"""
    num_prompts: int | None = None
    """how many of the shipped prompts the target answers (None: all)"""
    max_new_tokens: int = 192
    """length of each self-distilled answer"""
    generate_batch: int = 64
    """prompts the target answers together (one batched forward per decode step)"""
    temperature: float = 0.0
    """sampling temperature of the answers (0: greedy)"""
    draft_vocab_size: int = 2048
    """the head's own vocabulary: the most frequent tokens of the answers"""
    intermediate_size: int | None = None
    """the head's MLP width (None: the target's)"""
    ttt_steps: int = 3
    """training-time-test unroll: draft steps trained per position"""
    epochs: int = 4
    """passes over the captured data"""
    learning_rate: float = 1e-3
    """AdamW's peak learning rate (5% warm-up, cosine decay)"""
    chunk_tokens: int = 128
    """tokens packed into one optimizer step (small chunks, many steps: docs/performance.md)"""
    seed: int = 0
    """seeds the prompt order, sampling, initialisation and shuffling"""

    def __post_init__(self) -> None:
        for name in ("generate_batch", "chunk_tokens", "epochs", "ttt_steps", "max_new_tokens"):
            if getattr(self, name) < 1:
                flag = flag_of(name)
                raise ValueError(f"{flag} must be >= 1; got {getattr(self, name)}")
