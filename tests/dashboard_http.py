"""What the dashboard tests (tests/test_dashboard_*.py) share: a short greedy request, and
plain HTTP calls (urllib) answering status, headers and body, /dashboard/stats as JSON."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def http(url: str, body=None, headers=None, method=None) -> tuple[int, dict, bytes]:
    """`body`: raw if bytes, else JSON (sent as application/json unless `headers` say)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | (headers or {})
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def stats_of(url: str, headers=None) -> dict:
    status, _, body = http(url + "/dashboard/stats", headers=headers)
    assert status == 200, body
    return json.loads(body)
