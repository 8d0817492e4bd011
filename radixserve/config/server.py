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
    # 5: uvicorn's default, so SGLang's and vLLM's servers close idle connections as soon.
    timeout_keep_alive: float = 5.0
    """Seconds a connection may wait for a request's headers to complete: idle between
    requests (keep-alive) or a client sending headers slowly; then it is closed."""
    http_read_timeout: float = 60.0
    """Seconds a request's body may take to arrive in full; a client that stalls mid-body
    gets 408 and its connection is closed."""
    disable_dashboard: bool = False
    """Do not serve the live dashboard at /dashboard (behind --api-key when one is set)."""

    def verify(self) -> None:
        """Raises ValueError naming the first field out of range (a timeout of 0 would be
        none at all)."""
        for name in ("max_body_mb", "timeout_keep_alive", "http_read_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
