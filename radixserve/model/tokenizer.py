"""Tokenizer loading (offline) and chat-template rendering to token ids."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from radixserve.model.gguf_convert import converted_folder, tokenizer_folder
from radixserve.model.loader import LoadedModel, has_tokenizer, read_hf_config, weights_folder
from radixserve.model.quant.gguf_weights import field, read_gguf
from radixserve.model.source import (
    ModelLoadError,
    ModelSource,
    builtin_config,
    default_model_path,
    resolve_model,
)

logger = logging.getLogger(__name__)


def load_tokenizer(loaded: LoadedModel):
    """The model's own tokenizer; a dummy built-in config borrows the default model's one."""
    return open_tokenizer(loaded.tokenizer_path, loaded.config.vocab_size, loaded.name)


def model_tokenizer(model: str | None):
    """The tokenizer radixserve uses for the `model` argument, without loading weights."""
    return open_tokenizer(*tokenizer_source(model))


def tokenizer_source(model: str | None) -> tuple[Path | None, int, str]:
    """open_tokenizer's arguments for the `model` argument (path, vocab size, name), read
    from its config or GGUF metadata without loading weights."""
    source = resolve_model(model)
    if source.kind == "builtin":
        return None, builtin_config(source.name)["vocab_size"], source.name
    if source.kind == "gguf":
        return gguf_tokenizer_source(source)
    folder = weights_folder(model)
    vocab_size = read_hf_config(folder)["vocab_size"]
    return (folder if has_tokenizer(folder) else None), vocab_size, source.name


def gguf_tokenizer_source(source: ModelSource) -> tuple[Path | None, int, str]:
    """A GGUF's own tokenizer from its metadata alone: its weights are never dequantized (an
    8B file would need a 32 GB fp32 copy); one without a vocabulary gets the default's."""
    reader = read_gguf(source.path)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(f"{source.path} has no token_embd.weight tensor")
    vocab_size = int(embed.shape[1])  # ggml order: [hidden, vocab]
    has_vocab = field(reader, "tokenizer.ggml.model") is not None
    path = tokenizer_folder(source.path) if has_vocab else None
    return path, vocab_size, source.name


def import_tokenizer_library() -> None:
    """Imports what opening a tokenizer imports (transformers' AutoTokenizer, and through a
    model config its type validators, activations and hub kernels: ~4 s of CPU on transformers
    5): the server process does it before it forks its engine core, which opens a tokenizer
    too and so inherits the imports."""
    from transformers import AutoTokenizer, LlamaConfig  # noqa: F401


def open_tokenizer(path: Path | str | None, vocab_size: int, model_name: str):
    """Loads the tokenizer at `path` (None: the default model's), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if path is None:
        path = converted_folder(default_model_path())
        logger.warning("%s ships no tokenizer; using the default model's tokenizer", model_name)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if len(tokenizer) > vocab_size:
        raise ModelLoadError(
            f"tokenizer at {path} has {len(tokenizer)} tokens, more than the model's "
            f"vocab_size {vocab_size}"
        )
    return tokenizer


def chat_prompt_text(tokenizer, user_message: str) -> str:
    """A one-turn chat rendered by the tokenizer's own chat template, ready for generation."""
    if tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; drop --chat")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=False
    )
