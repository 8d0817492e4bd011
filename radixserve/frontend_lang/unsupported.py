"""SGLang frontend names that radixserve does not implement. Each exists, so a program
written for `sglang` imports, and raises NotImplementedError naming itself and what to use
instead when it is called."""

from __future__ import annotations

from typing import Any

TEXT_ONLY = "radixserve serves text-only models (no image or video inputs)"
OWN_ENGINE = (
    "radixserve's frontend runs programs on radixserve itself: "
    "set_default_backend(radixserve.Engine(...)) in-process, or RuntimeEndpoint(url) of a "
    "`radixserve serve`"
)


def image(expr: Any) -> Any:
    raise NotImplementedError(f"image: {TEXT_ONLY}")


def video(path: str, num_frames: int) -> Any:
    raise NotImplementedError(f"video: {TEXT_ONLY}")


def Runtime(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "Runtime: radixserve does not launch a server from Python; run `radixserve serve "
        "MODEL` and use RuntimeEndpoint(url), or use radixserve.Engine(MODEL) in-process"
    )


def ServerArgs(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "ServerArgs: radixserve's options are the fields of LoadConfig, CacheConfig and "
        "SchedulerConfig (radixserve.Engine(**options); `radixserve serve --help`)"
    )


def _hosted_api_backend(name: str):
    def backend(*args: Any, **kwargs: Any) -> Any:
        message = f"{name}: SGLang's hosted-API backends are not provided; {OWN_ENGINE}"
        raise NotImplementedError(message)

    backend.__name__ = backend.__qualname__ = name
    backend.__doc__ = f"SGLang's {name} backend: not provided (raises NotImplementedError)."
    return backend


OpenAI = _hosted_api_backend("OpenAI")
Anthropic = _hosted_api_backend("Anthropic")
LiteLLM = _hosted_api_backend("LiteLLM")
VertexAI = _hosted_api_backend("VertexAI")
Crusoe = _hosted_api_backend("Crusoe")
