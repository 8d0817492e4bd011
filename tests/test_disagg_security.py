"""The PD transfer's trust boundary, through the engine: a decode worker with the fleet's secret
inserts no page from a peer that cannot prove it (and its client learns nothing about why), a
flood of idle connections on a prefill worker's bootstrap port does not stop a real transfer,
and `radixserve fleet` hands every worker one secret file of its own making."""

from __future__ import annotations

import os
import socket
import stat
from concurrent.futures import wait

import pytest
from disagg_cores import HOST, assert_balanced, core, request, run, submit_pair

from conftest import prompt_ids
from radixserve.config import DisaggregationConfig, FleetConfig, SchedulerConfig, ServerConfig
from radixserve.disagg.auth import load_secret, write_secret_file
from radixserve.disagg.bootstrap_server import MAX_CONNECTIONS
from radixserve.disagg.kv_pages import page_nbytes
from radixserve.disagg.transfer import TcpKVTransfer
from radixserve.engine.protocol import Bootstrap
from radixserve.fleet.auth import pd_secret_file
from radixserve.fleet.launch import worker_children

PAGE = 16
FAILED = "KV transfer for bootstrap_room {} failed"


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pd-secret") / "secret")
    write_secret_file(path)
    return path


@pytest.fixture(scope="module")
def secure_pd(tiny_chat_model, secret_file):
    flags = {"disaggregation_transfer_timeout": 5.0, "disaggregation_secret_file": secret_file}
    prefill, decode = (
        core(tiny_chat_model, "prefill", **flags),
        core(tiny_chat_model, "decode", **flags),
    )
    single = core(tiny_chat_model)
    yield prefill, decode, single
    for c in (prefill, decode, single):
        c.close()


def alone(single, ids, max_new_tokens: int = 8):
    """The co-located worker's answer to `ids`."""
    ref = request(ids, max_new_tokens=max_new_tokens)
    single.scheduler.add_request(ref)
    run([single], [ref])
    return ref.output_ids


@pytest.mark.parametrize("stranger_secret", [None, b"not-the-fleets-secret"])
def test_pages_from_a_peer_without_the_secret_never_enter_the_tree(secure_pd, stranger_secret):
    _, decode, single = secure_pd
    ids = prompt_ids(41, 48)
    num_pages = len(ids) // PAGE
    # a peer that speaks the protocol and serves well-formed pages of the right prompt
    stranger = TcpKVTransfer(wait_timeout_s=2.0, secret=stranger_secret)
    port = stranger.listen(HOST, 0)
    try:
        nbytes = page_nbytes(decode.runner.pool)
        tokens = [ids[i * PAGE : (i + 1) * PAGE] for i in range(num_pages)]
        stranger.publish(77, tokens, [b"\x7f" * nbytes] * num_pages)
        poisoned = request(ids, room=77, port=port)
        decode.scheduler.add_request(poisoned)
        run([decode], [poisoned])
    finally:
        stranger.close()
    assert poisoned.finish_reason.is_abort and poisoned.output_ids == []
    assert poisoned.finish_reason.message == FAILED.format(77)  # no word of why
    assert decode.get_stats()["kv_pages_received"] == 0
    follow = request(ids)  # the same prompt, later: computed, not read from the stranger
    decode.scheduler.add_request(follow)
    run([decode], [follow])
    assert follow.cached_tokens == 0 and follow.output_ids == alone(single, ids)
    assert_balanced(decode)


def test_without_a_secret_a_foreign_bootstrap_host_is_refused_uniformly(tiny_chat_model):
    decode = core(tiny_chat_model, "decode", disaggregation_transfer_timeout=2.0)
    try:
        foreign = request(prompt_ids(42, 40), room=78, port=8998)
        foreign.bootstrap = Bootstrap("192.0.2.1", 8998, 78)  # what any /generate body may name
        decode.scheduler.add_request(foreign)
        run([decode], [foreign], timeout_s=5)
        assert foreign.finish_reason.message == FAILED.format(78)
        assert decode.get_stats()["kv_transfer_failures"] == 1
        assert_balanced(decode)
    finally:
        decode.close()


def test_a_real_transfer_goes_through_a_flood_of_idle_connections(secure_pd):
    prefill, decode, single = secure_pd
    server = prefill.scheduler.handoff._transfer.server
    server.handshake_timeout_s = 0.5  # how long an idle connection may hold a slot
    port = prefill.scheduler.handoff.bootstrap_port
    flood = [socket.create_connection((HOST, port)) for _ in range(MAX_CONNECTIONS + 16)]
    try:
        ids = prompt_ids(43, 40)
        p, d = submit_pair(prefill, decode, ids)
        run([prefill, decode], [p, d], timeout_s=20)
        assert d.finish_reason.kind == "length" and d.output_ids == alone(single, ids)
        assert d.cached_tokens == 32 and server.num_refused >= 16
    finally:
        for conn in flood:
            conn.close()
    assert_balanced(prefill, decode)


def test_a_decode_side_abort_drops_the_prefill_sides_room(secure_pd):
    prefill, decode, _ = secure_pd
    p, d = submit_pair(prefill, decode, prompt_ids(44, 40))
    decode.scheduler.step()  # d's fetch waits for the room
    fetch = d.kv_future
    decode.scheduler.abort_request(d.request_id)
    run([decode], [d])
    wait([fetch], timeout=5)  # done once the prefill side acknowledged the room's drop
    assert fetch.done()
    run([prefill], [p])  # publishes the room: discarded, its decode worker gone
    assert d.finish_reason.is_abort and p.finish_reason.kind == "length"
    assert prefill.scheduler.handoff._transfer.num_rooms() == 0
    assert_balanced(prefill, decode)


# ---- the secret file and the flags ------------------------------------------------------


def test_a_secret_file_must_be_private_and_long_enough(tmp_path):
    path = tmp_path / "secret"
    write_secret_file(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(load_secret(str(path))) == 64
    with pytest.raises(FileExistsError):
        write_secret_file(str(path))  # never overwrites
    path.chmod(0o644)
    with pytest.raises(ValueError, match="--disaggregation-secret-file .*open to group or others"):
        load_secret(str(path))
    short = tmp_path / "short"
    short.write_text("abc\n")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_secret(str(short))
    with pytest.raises(ValueError, match="--disaggregation-secret-file .*cannot read"):
        load_secret(str(tmp_path / "missing"))


def test_serving_kv_beyond_loopback_needs_a_secret(secret_file):
    config = DisaggregationConfig(
        disaggregation_mode="prefill", disaggregation_bootstrap_host="0.0.0.0"
    )
    with pytest.raises(ValueError, match="--disaggregation-secret-file"):
        config.verify(SchedulerConfig(), 1)
    config.disaggregation_secret_file = secret_file
    config.verify(SchedulerConfig(), 1)
    with pytest.raises(ValueError, match="--disaggregation-room-budget-mb"):
        DisaggregationConfig(disaggregation_room_budget_mb=-1).verify(SchedulerConfig(), 1)


def test_a_pd_fleet_makes_one_private_secret_for_all_its_workers(secret_file):
    config = FleetConfig(prefill_workers=1, decode_workers=1)
    with pd_secret_file(config, {"model": "m"}) as engine_args:
        path = engine_args["disaggregation_secret_file"]
        folder = os.path.dirname(path)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and load_secret(path)
        assert not os.path.abspath(path).startswith(os.getcwd() + os.sep)
        commands = [w.command for w in worker_children(config, ServerConfig(), engine_args)]
        assert all(c[c.index("--disaggregation-secret-file") + 1] == path for c in commands)
    assert not os.path.exists(folder)  # removed with the fleet
    given = {"model": "m", "disaggregation_secret_file": secret_file}
    with pd_secret_file(config, given) as engine_args:
        assert engine_args == given  # the operator's own file is used, and kept
    with pd_secret_file(FleetConfig(workers=2), {"model": "m"}) as engine_args:
        assert "disaggregation_secret_file" not in engine_args
    assert os.path.exists(secret_file)
