"""ServerConfig: the HTTP server around the engine core."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    """The HTTP server around the engine core."""

    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = 30000
    """Port to listen on."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>` on every endpoint but health and metrics."""
    max_queued_requests: int = 1024
    """Requests allowed to wait beyond the running batch; more are answered 503."""
    served_model_name: str | None = None
    """Model name reported by /v1/models and accepted in `model`; default: the model's name."""
    log_level: str = "warning"
    """debug | info | warning | error."""
    max_body_mb: float = 32.0
    """Largest request body accepted, in MiB (larger: 413)."""
    tool_call_parser: str | None = None
    """Tool-call format: qwen25 (alias hermes), llama3 (llama3_json), mistral, pythonic,
    deepseekv3 (deepseek_v3), qwen3_coder; default: the chat template's, else qwen25."""
    disable_dashboard: bool = False
    """Do not serve the live dashboard at /dashboard (behind --api-key when one is set)."""
