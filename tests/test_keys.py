"""API keys from flag, file or environment; which settings are secrets; the fleet's keys
(router and workers), never on a command line."""

from __future__ import annotations

import logging
import os

import pytest

from radixserve.config import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    FleetConfig,
    ServerConfig,
    is_secret_field,
    redact_secrets,
    resolve_keys,
)
from radixserve.fleet import router_main
from radixserve.fleet.auth import fleet_keys
from radixserve.fleet.launch import fleet_children
from radixserve.fleet.router_main import ROUTER_API_KEY_ENV


def key_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "key"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_flag_beats_file_beats_environment_and_the_variables_are_removed(tmp_path):
    environ = {API_KEY_ENV: "from-env", ADMIN_API_KEY_ENV: "admin-env", "OTHER": "1"}
    config = resolve_keys(ServerConfig(), dict(environ))
    assert (config.api_key, config.admin_api_key) == ("from-env", "admin-env")
    path = key_file(tmp_path, "from-file\n")
    env = dict(environ)
    config = resolve_keys(ServerConfig(api_key_file=path), env)
    assert config.api_key == "from-file" and env == {"OTHER": "1"}  # never inherited
    config = resolve_keys(ServerConfig(api_key="from-flag", api_key_file=path), dict(environ))
    assert config.api_key == "from-flag"
    assert resolve_keys(ServerConfig(), {API_KEY_ENV: ""}).api_key is None  # empty: unset


def test_a_key_file_others_can_read_is_warned_about(tmp_path, caplog):
    path = key_file(tmp_path, "k3y", mode=0o644)
    with caplog.at_level(logging.WARNING, logger="radixserve.config.keys"):
        assert resolve_keys(ServerConfig(admin_api_key_file=path), {}).admin_api_key == "k3y"
    assert "--admin-api-key-file" in caplog.text and "chmod 600" in caplog.text


@pytest.mark.parametrize(
    ("config", "environ", "message"),
    [
        (ServerConfig(api_key_file="/nonexistent/key"), {}, "--api-key-file '/nonexistent/key'"),
        (ServerConfig(api_key="two words"), {}, "--api-key must be printable ASCII"),
        (ServerConfig(), {ADMIN_API_KEY_ENV: "k\u00e9y"}, r"\$RADIXSERVE_ADMIN_API_KEY"),
        (ServerConfig(api_key="same"), {ADMIN_API_KEY_ENV: "same"}, "must differ"),
    ],
)
def test_bad_keys_are_errors_naming_their_source(config, environ, message):
    with pytest.raises(ValueError, match=message):
        resolve_keys(config, environ)


def test_an_empty_key_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="--api-key-file .* is empty"):
        resolve_keys(ServerConfig(api_key_file=key_file(tmp_path, "\n")), {})


def test_secrets_are_redacted_by_name_nested_too():
    for name in ("api_key", "admin_api_key_file", "hf_token", "disaggregation_secret_file"):
        assert is_secret_field(name), name
    for name in ("bos_token_id", "max_prefill_tokens", "tokenizer_path", "keep_alive_s"):
        assert not is_secret_field(name), name
    values = {"api_key": "x", "port": 1, "nested": {"password": "y", "page_size": 16}}
    assert redact_secrets(values) == {"port": 1, "nested": {"page_size": 16}}


def test_fleet_keys_reach_router_and_workers_by_environment_only(tiny_chat_model):
    engine_args = {"model": tiny_chat_model, "device": "cpu"}
    keyed = ServerConfig(api_key="router-key-0f3e")
    workers, router = fleet_children(FleetConfig(workers=2), keyed, engine_args)
    assert router.env == {ROUTER_API_KEY_ENV: "router-key-0f3e"}
    assert all(w.env[API_KEY_ENV] == "router-key-0f3e" for w in workers)
    for child in [router, *workers]:
        assert not any("router-key-0f3e" in arg for arg in child.command)
    assert "--worker-urls" not in router.command  # they register with their key
    workers, router = fleet_children(FleetConfig(workers=2), ServerConfig(), engine_args)
    drawn = {w.env[API_KEY_ENV] for w in workers}
    assert len(drawn) == 1 and len(drawn.pop()) >= 32 and router.env == {}
    pd = FleetConfig(prefill_workers=1, decode_workers=1)
    pd_keys = fleet_keys(ServerConfig(), pd.pd_disaggregation)  # see fleet/auth.py
    assert pd_keys.router is None and pd_keys.workers is None
    assert pd_keys.worker_env() == {ADMIN_API_KEY_ENV: pd_keys.workers_admin}
    assert len(pd_keys.workers_admin) >= 32
    with pytest.raises(ValueError, match="--admin-api-key is not a fleet flag"):
        fleet_keys(ServerConfig(admin_api_key="a"), False)


def test_router_launcher_takes_its_key_from_the_environment(monkeypatch):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    launched = []
    monkeypatch.setattr("sglang_router.launch_router.launch_router", launched.append)
    monkeypatch.setenv(ROUTER_API_KEY_ENV, "router-key-77")
    router_main.main(["--worker-urls", "http://127.0.0.1:1"])
    assert launched[0].api_key == "router-key-77"
    assert ROUTER_API_KEY_ENV not in os.environ
