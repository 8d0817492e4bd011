"""ServerConfig: the HTTP server around the engine core."""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from dataclasses import dataclass

MAX_PORT = 65535
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""--log-level's choices, in any case (logging's level names)."""


@dataclass
class ServerConfig:
    """The HTTP server around the engine core."""

    host: str = "127.0.0.1"
    """Address to bind (an IP address, or a host name that resolves); loopback unless told
    otherwise."""
    port: int = 30000
    """Port to listen on."""
    api_key: str | None = None
    """The user key: `Authorization: Bearer <key>` on every route but health and metrics
    (generation, own pins, introspection of the caller's own namespace). Without
    --admin-api-key it opens the admin routes too. Prefer --api-key-file or
    RADIXSERVE_API_KEY: a flag shows in `ps`."""
    api_key_file: str | None = None
    """Read --api-key from this file (one line; warned about when group/other can read it)."""
    admin_api_key: str | None = None
    """The admin key (SGLang's flag): /flush_cache, /check_integrity, /cache/tree and
    /cache/sessions of every namespace, and the dashboard. Prefer --admin-api-key-file or
    RADIXSERVE_ADMIN_API_KEY."""
    admin_api_key_file: str | None = None
    """Read --admin-api-key from this file (one line; warned about when group/other can read
    it)."""
    allowed_hosts: str | None = None
    """Comma-separated host names (no port) that requests without a key may name in Host and
    Origin besides loopback and --host (DNS-rebinding guard), e.g. "myhost,myhost.lan"."""
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
    reasoning_parser: str | None = None
    """Reasoning format, split out of chat outputs (`reasoning_content`, Messages' thinking
    blocks): deepseek-r1 (also qwen3-thinking), qwen3, gpt-oss; default: none."""
    completion_template: str | None = None
    """Fill-in-the-middle format of /v1/completions' `suffix` (and Ollama generate's):
    deepseek_coder, star_coder, qwen_coder (SGLang's names); default: the one whose special
    tokens the model's vocabulary holds (none: a suffix is a 400)."""
    # 5: uvicorn's default, so SGLang's and vLLM's servers close idle connections as soon.
    timeout_keep_alive: float = 5.0
    """Seconds a connection may wait for a request's headers to complete: idle between
    requests (keep-alive) or a client sending headers slowly; then it is closed."""
    http_read_timeout: float = 60.0
    """Seconds a request's body may take to arrive in full; a client that stalls mid-body
    gets 408 and its connection is closed."""
    responses_store_max_entries: int = 10000
    """Most responses `/v1/responses` keeps (`store: true`) for GET, DELETE and
    `previous_response_id`; the oldest go first."""
    responses_store_max_mb: float = 64.0
    """Largest total size of the stored responses, in MiB (their JSON, each with its chain's
    history); the oldest go first."""
    responses_store_ttl: float = 3600.0
    """Seconds a stored response is kept."""
    disable_dashboard: bool = False
    """Do not serve the live dashboard at /dashboard (behind the admin key when one is set)."""
    router_url: str | None = None
    """A running sglang-router (http://host:port) this worker joins by itself once healthy
    (its POST /workers, with this worker's key; PD mode: its --disaggregation-mode and
    bootstrap port), re-joins when the router forgets it, and leaves first on SIGTERM. The
    router's own key, if it differs from --api-key: $RADIXSERVE_ROUTER_API_KEY."""
    advertise_url: str | None = None
    """The URL the router reaches this worker at (with --router-url); default
    http://<--host>:<--port>."""
    drain_timeout: float = 30.0
    """Seconds SIGTERM lets running requests finish (new ones get 503, /health 503) before
    it aborts the rest and exits 0."""

    def allowed_host_names(self) -> frozenset[str]:
        """--allowed-hosts as lower-case names."""
        names = (self.allowed_hosts or "").split(",")
        return frozenset(name.strip().lower() for name in names if name.strip())

    def verify(self) -> None:
        """Raises ValueError naming the first field out of range (a timeout of 0 would be
        none at all)."""
        positive = (
            "max_body_mb",
            "timeout_keep_alive",
            "http_read_timeout",
            "drain_timeout",
            "responses_store_max_entries",
            "responses_store_max_mb",
            "responses_store_ttl",
        )
        for name in positive:  # finite: sizes become ints, timeouts deadlines
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a number > 0; got {getattr(self, name)}")
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port must be in [0, {MAX_PORT}]; got {self.port}")
        check_host(self.host, "host")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError(
                f"served_model_name must name the model (unset: its own name); "
                f"got {self.served_model_name!r}"
            )
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0; got {self.max_queued_requests}")
        if self.log_level.lower() not in LOG_LEVELS:
            allowed = " | ".join(LOG_LEVELS)
            raise ValueError(f"log_level must be {allowed}; got {self.log_level!r}")
        for name in ("router_url", "advertise_url"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"{name} must be an http(s):// URL; got {url!r}")
        if self.advertise_url is not None and self.router_url is None:
            raise ValueError("advertise_url is what --router-url is told; give --router-url too")


HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_host(host: str, flag: str) -> None:
    """ValueError naming `flag` unless `host` is an IP address or a host name (dot-separated
    labels of letters, digits and inner hyphens, the last not all digits: RFC 3696). IPv4
    shorthands are refused: getaddrinfo reads "1.5" as 1.0.0.5 and "0x10" as 0.0.0.16."""
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        return
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    shorthand = True
    try:
        socket.inet_aton(host)
    except OSError:
        shorthand = False
    named = all(HOST_LABEL.fullmatch(x) for x in labels) and not labels[-1].isdigit()
    if shorthand or len(host) > 253 or not named:
        raise ValueError(f"{flag} must be an IP address or a host name; got {host!r}")


def check_resolves(host: str, port: int, flag: str) -> None:
    """`host` (given as `flag`) resolves to an address: else binding it fails only once the
    model has loaded."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{flag} {host!r} does not resolve to an address: {exc}") from None
