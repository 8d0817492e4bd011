"""The fleet's own port (--fleet-port; the router's belongs to sglang-router).

    GET /              the dashboard (fleet_dashboard.html: one file, no external assets)
    GET /fleet/stats   JSON: workers side by side, decisions, timeline (FleetState.snapshot)
    GET /metrics       Prometheus: radixserve_fleet:* (workers by state, desired, decisions
                       by action and rule, waiting / running, TTFT slow share)

With a fleet key (--api-key) /fleet/stats and /metrics need `Authorization: Bearer KEY`; the
page itself holds no data and sends the key it is given after `#key=` in its address (the
fragment never leaves the browser).
"""

from __future__ import annotations

import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

from radixserve.fleet.autoscale import DOWN_RULES, UP_RULES

if TYPE_CHECKING:
    from radixserve.fleet.autoscale_fleet import FleetState

DASHBOARD_HTML = Path(__file__).with_name("fleet_dashboard.html")
PREFIX = "radixserve_fleet:"


class FleetCollector:
    """The fleet's state as Prometheus families, read at scrape time."""

    def __init__(self, state: FleetState) -> None:
        self.state = state

    def collect(self):
        snap = self.state.snapshot()
        workers = GaugeMetricFamily(PREFIX + "workers", "Workers by state", labels=["state"])
        for name, count in snap["num_workers"].items():
            workers.add_metric([name], count)
        yield workers
        desired = snap["desired_workers"]
        yield GaugeMetricFamily(PREFIX + "desired_workers", "Workers aimed at", value=desired)
        decisions = CounterMetricFamily(
            PREFIX + "scaling_decisions",
            "Workers added (up) and drained (down), by the rule that decided",
            labels=["action", "rule"],
        )
        for action, rules in (("up", UP_RULES), ("down", DOWN_RULES)):
            for rule in rules:
                count = snap["num_decisions"].get(f"{action}/{rule}", 0)
                decisions.add_metric([action, rule], count)
        yield decisions
        for what in ("waiting", "running"):
            total = sum(w[f"num_{what}"] or 0 for w in snap["workers"])
            doc = f"Requests {what}, summed over serving workers"
            yield GaugeMetricFamily(PREFIX + f"num_requests_{what}", doc, value=total)
        if snap["ttft_slow_fraction"] is not None:
            yield GaugeMetricFamily(
                PREFIX + "ttft_slow_fraction",
                "Share of first tokens since the last scrape slower than --scale-up-ttft-target-s",
                value=snap["ttft_slow_fraction"],
            )


class FleetView:
    """The fleet port's HTTP server, in a daemon thread."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self.server, self.thread = server, thread

    @classmethod
    def start(cls, state: FleetState, host: str, port: int, key: str | None) -> FleetView:
        registry = CollectorRegistry()
        registry.register(FleetCollector(state))
        fields = {"state": state, "key": key, "registry": registry}
        handler = type("Handler", (FleetHandler,), fields)
        server = ThreadingHTTPServer((host, port), handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, name="fleet-view", daemon=True)
        thread.start()
        return cls(server, thread)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FleetHandler(BaseHTTPRequestHandler):
    state: FleetState
    key: str | None
    registry: CollectorRegistry

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(200, "text/html; charset=utf-8", DASHBOARD_HTML.read_bytes())
        elif path not in ("/fleet/stats", "/metrics"):
            self._error(404, f"no route {path}; try /, /fleet/stats or /metrics")
        elif not self._authorized():
            self._error(401, "this route needs the fleet's key (--api-key) as a Bearer token")
        elif path == "/metrics":
            self._send(200, "text/plain; version=0.0.4", generate_latest(self.registry))
        else:
            self._send(200, "application/json", json.dumps(self.state.snapshot()).encode())

    def _authorized(self) -> bool:
        if self.key is None:
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.key}".encode())

    def _error(self, status: int, message: str) -> None:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
        self._send(status, "application/json", json.dumps(body).encode())

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        """Requests are not logged (a dashboard polls every second)."""
