"""Which model a request names (the served one or a LoRA adapter of it), and SGLang's LoRA
admin routes (admin key when keys are set: auth.py ADMIN_PATHS):

    POST /load_lora_adapter    {"lora_name", "lora_path"}  a PEFT folder, served at once
    POST /unload_lora_adapter  {"lora_name"}               refused while its requests run

Both answer SGLang's {"success", "error_message", "loaded_adapters": {name: path}}; a
refusal is a 400 with success false. The request builder's adapter map is replaced by the
core's after each, so a request names only adapters the core serves.
"""

from __future__ import annotations

import time

from aiohttp import web

from radixserve.server.errors import BadRequest
from radixserve.server.state import ServerState, read_json, state_of


def check_model_name(state: ServerState, model: str | None) -> str | None:
    """A request may name the served model, a LoRA adapter of it (returned: the adapter the
    request runs with) or none; any other name is a 404."""
    if model in state.builder.lora_adapters:
        return model
    if model is not None and model != state.served_model_name:
        raise BadRequest(
            f"model {model!r} does not exist; this server serves {state.served_model_name!r}"
            + "".join(f", {name!r}" for name in sorted(state.builder.lora_adapters)),
            param="model",
            status=404,
        )
    return None


def adapter_names(state: ServerState) -> list[str]:
    """The LoRA adapters loaded now, by name, in order: what every model list shows after the
    served model."""
    return sorted(state.builder.lora_adapters)


def model_cards(state: ServerState) -> list[dict]:
    """/v1/models' entries: the served model's card, then its LoRA adapters' (SGLang's: a
    model whose parent is the base)."""
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "radixserve",
        "root": state.model_path,
        "max_model_len": state.client.info["context_length"],
    }
    return [card] + [
        card | {"id": name, "root": name, "parent": state.served_model_name}
        for name in adapter_names(state)
    ]


def register_lora_routes(app: web.Application) -> None:
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request, ("lora_name", "lora_path"))
    return await _change(state_of(request), "load_lora_adapter", body)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request, ("lora_name",))
    return await _change(state_of(request), "unload_lora_adapter", body)


async def _body(request: web.Request, names: tuple[str, ...]) -> dict[str, str]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    for name in names:
        if not isinstance(body.get(name), str) or not body[name]:
            raise BadRequest(f"{name} must be a non-empty string", param=name)
    extra = sorted(set(body) - set(names) - {"pinned"})  # SGLang's `pinned`: accepted, not honoured
    if extra:
        raise BadRequest(f"{extra[0]} is not supported by this route", param=extra[0])
    return {name: body[name] for name in names}


async def _change(state: ServerState, method: str, args: dict[str, str]) -> web.Response:
    try:
        adapters = await state.client.call(method, **args)
    except RuntimeError as exc:  # the core's refusal, "ValueError: ..."
        message = str(exc).removeprefix("ValueError: ")
        return web.json_response(
            {"success": False, "error_message": message, "loaded_adapters": None}, status=400
        )
    state.builder.lora_adapters = adapters["ids"]  # replaced, never edited: builds read it
    return web.json_response(
        {"success": True, "error_message": "", "loaded_adapters": adapters["paths"]}
    )
