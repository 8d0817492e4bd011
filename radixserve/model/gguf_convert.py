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
from functools import partial
from pathlib import Path

from radixserve.disk_cache import cache_root
from radixserve.model.source import ModelLoadError

logger = logging.getLogger(__name__)


def converted_folder(gguf_path: Path) -> Path:
    """Returns the HF folder converted from `gguf_path`, converting it on first use."""
    target = _cache_target(gguf_path, "gguf")
    if not (target / "config.json").is_file():
        _write_once(target, "config.json", partial(_convert, gguf_path.resolve()))
    return target


def tokenizer_folder(gguf_path: Path) -> Path:
    """A folder with the GGUF's tokenizer alone (the converted folder, if it exists): what
    `--quantization gguf` needs, without dequantizing the weights."""
    converted = _cache_target(gguf_path, "gguf")
    if (converted / "tokenizer_config.json").is_file():
        return converted
    target = _cache_target(gguf_path, "gguf-tokenizer")
    if not (target / "tokenizer_config.json").is_file():
        write = partial(_convert_tokenizer, gguf_path.resolve())
        _write_once(target, "tokenizer_config.json", write)
    return target


def _cache_target(gguf_path: Path, kind: str) -> Path:
    gguf_path = gguf_path.resolve()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / kind / f"{gguf_path.stem}-{key}"


def _write_once(target: Path, marker: str, write) -> None:
    """Fills `target` through a temporary folder renamed into place (safe across processes)."""
    logger.info("converting to %s (once)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def _convert_tokenizer(gguf_path: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot read the tokenizer of GGUF file {gguf_path}: {exc}") from exc
    tokenizer.save_pretrained(out)
