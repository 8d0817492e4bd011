"""GGUF -> cached HF folder (fp32 safetensors + config + tokenizer), done once per file.

Dequantizing a GGUF through transformers takes ~15 s for SmolLM2; the converted folder
loads in well under a second, so tests and servers start fast after the first run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from radixserve.model.source import ModelLoadError

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """$RADIXSERVE_CACHE_DIR, else ~/.cache/radixserve."""
    env = os.environ.get("RADIXSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixserve"


def converted_folder(gguf_path: Path) -> Path:
    """Returns the HF folder converted from `gguf_path`, converting it on first use."""
    gguf_path = gguf_path.resolve()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to %s (once)", gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf_path, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf_path: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
