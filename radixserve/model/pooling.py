"""What an embedding checkpoint says about its pooling (sentence-transformers' `modules.json`
and its Pooling module's `config.json`), checked against the one `--is-embedding` serves: the
last token's hidden state (engine/commit.py), which the prefix cache can serve from any hit.
Mean or CLS pooling would need every prompt token's row, cached or not: refused at start."""

from __future__ import annotations

import json
from pathlib import Path

from radixserve.config.model import UnsupportedModelError

POOLING_MODULE = "sentence_transformers.models.Pooling"


def pooling_modes(folder: Path) -> list[str]:
    """The pooling modes the folder's sentence-transformers Pooling module turns on (e.g.
    ["lasttoken"]); [] when it has none (a plain transformers checkpoint)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return []
    try:
        modules = json.loads(modules_file.read_text())
        [pooling] = [m for m in modules if m.get("type") == POOLING_MODULE] or [None]
        if pooling is None:
            return []
        config = json.loads((folder / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UnsupportedModelError(f"cannot read the pooling config in {folder}: {exc}") from exc
    return sorted(k.removeprefix("pooling_mode_") for k, on in config.items()
                  if k.startswith("pooling_mode_") and on is True)  # fmt: skip


def check_last_token_pooling(folder: Path) -> None:
    """Refuses a checkpoint whose sentence-transformers config pools otherwise than by the
    last token (mean, CLS, max): its embeddings would differ from what the model was trained
    to give."""
    modes = pooling_modes(folder)
    if modes and modes != ["lasttoken"]:
        raise UnsupportedModelError(
            f"{folder} pools by {', '.join(modes)} (its sentence-transformers Pooling config); "
            "--is-embedding serves last-token pooling only"
        )
