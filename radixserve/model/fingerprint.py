"""A model's identity for caches that outlive the process (the hierarchical cache's file)."""

from __future__ import annotations

import hashlib
import json

import torch

from radixserve.model.loader import LoadedModel

SAMPLED_TENSORS = 3  # the first, middle and last weight tensors are hashed
SAMPLED_ELEMENTS = 4096  # of each, this many leading elements: cheap for any model size


def model_fingerprint(loaded: LoadedModel) -> str:
    """SHA-256 of the model's name, config, quantization, dtype and a sample of its weights:
    two loads of the same weights agree, a retrained or requantized model does not."""
    digest = hashlib.sha256()
    header = {
        "name": loaded.name,
        "config": loaded.config.hf_config,
        "quantization": loaded.quantization,
        "dtype": str(loaded.dtype),
    }
    digest.update(json.dumps(header, sort_keys=True, default=str).encode())
    tensors = list(loaded.model.state_dict().items())
    picks = {0, len(tensors) // 2, len(tensors) - 1} if tensors else set()
    for i in sorted(picks)[:SAMPLED_TENSORS]:
        name, tensor = tensors[i]
        digest.update(name.encode())
        digest.update(_leading_bytes(tensor))
    return digest.hexdigest()


def _leading_bytes(tensor: torch.Tensor) -> bytes:
    head = tensor.detach().flatten()[:SAMPLED_ELEMENTS].cpu().contiguous()
    return head.view(torch.uint8).numpy().tobytes()
