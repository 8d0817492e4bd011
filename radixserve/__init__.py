"""radixserve: an LLM serving runtime built around RadixAttention.

The public names load on first use (PEP 562), so that `import radixserve.<module>` of a
torch-free module (the configs, the command line) does not load torch: `radixserve serve`
sets OpenMP's variables before torch loads (client/core_start.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_HOMES = {
    "CacheConfig": "radixserve.config",
    "Engine": "radixserve.client.engine",
    "LoadConfig": "radixserve.config",
    "ModelConfig": "radixserve.config",
    "SamplingParams": "radixserve.sampling.params",
    "SchedulerConfig": "radixserve.config",
}
# The frontend language under SGLang's top-level names: `import radixserve as sgl` runs
# programs written for `import sglang as sgl`; its names come from frontend_lang.__all__.
_FRONTEND = "radixserve.frontend_lang"

if TYPE_CHECKING:
    from radixserve.client.engine import Engine as Engine
    from radixserve.config import CacheConfig as CacheConfig
    from radixserve.config import LoadConfig as LoadConfig
    from radixserve.config import ModelConfig as ModelConfig
    from radixserve.config import SchedulerConfig as SchedulerConfig
    from radixserve.frontend_lang import *  # noqa: F403
    from radixserve.sampling.params import SamplingParams as SamplingParams


def _public_names() -> list[str]:
    names = [*sorted(_HOMES), "__version__"]
    frontend = importlib.import_module(_FRONTEND).__all__
    return names + [name for name in frontend if name not in names]


def __getattr__(name: str) -> Any:
    if name == "__all__":
        value: Any = _public_names()
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif name.startswith("__"):
        raise AttributeError(name)
    else:
        frontend = importlib.import_module(_FRONTEND)
        if name not in frontend.__all__:
            raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
        value = getattr(frontend, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_public_names()))
