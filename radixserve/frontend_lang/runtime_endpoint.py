"""RuntimeEndpoint: a running `radixserve serve` (or any server with SGLang's native API).

Speaks `POST /generate` and `GET /get_model_info` / `/server_info` with the standard
library only. The tokenizer (for chat templates and select's token boundaries) is loaded
locally from the path the server reports, so the server must run on this machine or share
its model folder.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from radixserve.frontend_lang.backends import Backend, Output
from radixserve.frontend_lang.roles import ChatTemplate

DEFAULT_TIMEOUT_S = 600.0


class RuntimeEndpoint(Backend):
    """`RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)`, as in SGLang."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        chat_template: ChatTemplate | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        super().__init__(chat_template)
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.model_info = self._call("GET", "/get_model_info")

    # ---- Backend -------------------------------------------------------------------------

    def request(self, payload: dict[str, Any]) -> Output | list[Output]:
        return self._call("POST", "/generate", payload)

    def request_stream(self, payload: dict[str, Any]) -> Iterator[Output]:
        with self._open("POST", "/generate", {**payload, "stream": True}) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _error_for(self.base_url + "/generate", 400, chunk)
                yield chunk

    @property
    def tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def flush_cache(self) -> bool:
        try:
            self._call("POST", "/flush_cache")
        except (ValueError, RuntimeError):  # 400 while requests run
            return False
        return True

    def get_server_info(self) -> dict[str, Any]:
        return self._call("GET", "/server_info")

    # ---- HTTP ----------------------------------------------------------------------------

    def _load_tokenizer(self):
        from radixserve.model.tokenizer import open_tokenizer

        engine = self.get_server_info().get("engine", {})
        path = engine.get("tokenizer_path", self.model_info.get("tokenizer_path"))
        name = engine.get("model_name", self.model_info.get("model_path", self.base_url))
        return open_tokenizer(path, engine.get("vocab_size", 1 << 62), name)

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        with self._open(method, path, body) as resp:
            text = resp.read().decode("utf-8")
        return json.loads(text) if text.startswith(("{", "[")) else text

    def _open(self, method: str, path: str, body: dict | None = None):
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(url, data=data, method=method, headers=self._headers())
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise _error_for(url, exc.code, _json_body(exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ConnectionError(f"cannot reach the server at {url}: {reason}") from None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def _json_body(exc: urllib.error.HTTPError) -> Any:
    text = exc.read().decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def _error_for(url: str, status: int, body: Any) -> Exception:
    """400s are the caller's mistake (ValueError, like the Engine); the rest RuntimeError."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else str(body).strip()
    cls = ValueError if status == 400 else RuntimeError
    return cls(f"{url} answered {status}: {message}")
