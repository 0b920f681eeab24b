"""Client, Session, DaemonSource and EmbeddedDaemon: the agent's full precision in specached's
pages gives the same bytes as in process memory; stats are dicts; failures carry their code."""

import os

import pytest

import specache
from replay import WORKLOADS, inputs, run_python
from specache import StatusCode, StatusError


@pytest.fixture()
def daemon():
    d = specache.EmbeddedDaemon(pool_bytes=64 << 20, chunk_bytes=16 << 20)
    yield d
    d.stop()


def test_build_has_the_service_half():
    # CI builds on a machine with the Debian packages of the service (tools/setup.sh).
    assert specache.has_service


def test_agent_on_daemon_pages_matches_process_memory(daemon):
    w = WORKLOADS["specache-1bit"]
    calls = inputs(w)
    in_process = run_python(specache.Agent(w.shape, w.kv), w, calls).to_bytes()
    client = specache.Client.connect(daemon.socket)
    session = client.open_session("default", 32 << 20)
    source = specache.DaemonSource(session, page_tokens=64, capacity_tokens=512)
    agent = specache.Agent(w.shape, w.kv, source)
    assert run_python(agent, w, calls).to_bytes() == in_process
    assert source.stored_bytes == agent.stats()["full_precision_bytes"]
    # One ExtendSequence per sequence makes the prompt's pages (all layers at once); the 7 decoded
    # rows (150 + 7 < 3 pages, 97 + 7 < 2 pages of 64) need no other.
    assert source.extend_rpcs == 2
    daemon_id = source.daemon_sequence(100)
    listed = {s["id"]: s for s in client.list_sequences()}
    assert listed[daemon_id]["state"] == "session"
    assert listed[daemon_id]["layout"]["n_layers"] == w.shape.n_layers
    # The source's (and its agent's) sequence: not released nor kept through the session behind
    # its back (its pages would go to the next sequence made while the agent still writes them).
    for call in (session.release, session.keep):
        with pytest.raises(StatusError) as info:
            call(daemon_id)
        assert info.value.code == StatusCode.FAILED_PRECONDITION
    assert {s["id"] for s in client.list_sequences()} >= {daemon_id}


def test_stats_are_dicts(daemon):
    client = specache.Client.connect(daemon.socket, client_name="pytest")
    stats = client.stats()
    assert stats["pool_bytes"] == 64 << 20
    assert stats["sessions"] == 0
    session = client.open_session("default", 16 << 20)
    assert session.alive and session.chunk_count == 1 and session.chunk_bytes == 16 << 20
    stats = client.stats()
    assert stats["sessions"] == 1 and stats["reserved_bytes"] == 16 << 20
    assert [t["tenant"] for t in stats["tenants"]] == ["default"]
    sessions = client.list_sessions()
    assert sessions[0]["client_name"] == "pytest" and sessions[0]["pid"] == os.getpid()
    del session  # the session ends with its object: its chunks return to the pool
    assert client.stats()["reserved_bytes"] == 0


def test_session_sequences(daemon):
    client = specache.Client.connect(daemon.socket)
    session = client.open_session("default", 16 << 20)
    seq = session.create_sequence(n_layers=2, n_kv_heads=2, head_dim=64, capacity_tokens=256)
    assert session.extend(seq, 100) == 2
    assert session.pages_per_layer(seq) == 2
    session.release(seq)
    with pytest.raises(StatusError) as info:
        session.extend(seq, 10)
    assert info.value.code == StatusCode.NOT_FOUND
    # int8 rows: their own row format in the daemon's listing, pages of 2 x 64 + 16 bytes a row
    seq = session.create_sequence(n_layers=2, n_kv_heads=2, head_dim=64, capacity_tokens=256, row_format="int8")
    assert session.extend(seq, 100) == 2
    listed = {s["id"]: s for s in client.list_sequences()}
    assert listed[seq]["layout"]["row_format"] == "int8"
    assert listed[seq]["bytes"] == 2 * 2 * 64 * 2 * (2 * 64 + 16)  # layers x pages x (heads x tokens) x row
    with pytest.raises(StatusError) as info:
        session.create_sequence(n_layers=2, n_kv_heads=2, head_dim=64, capacity_tokens=256, row_format="int4")
    assert info.value.code == StatusCode.INVALID_ARGUMENT


def test_daemon_errors_carry_their_codes(daemon, tmp_path):
    with pytest.raises(StatusError) as info:
        specache.Client.connect(str(tmp_path / "nobody.sock"), deadline_ms=300)
    assert info.value.code == StatusCode.UNAVAILABLE
    client = specache.Client.connect(daemon.socket)
    with pytest.raises(StatusError) as info:
        client.open_session("default", 1 << 40)  # more than the tenant's quota
    assert info.value.code == StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(StatusError) as info:
        client.open_session("nobody", 16 << 20)
    assert info.value.code in (StatusCode.NOT_FOUND, StatusCode.PERMISSION_DENIED)
    with pytest.raises(StatusError) as info:  # a clear error, not a division by zero
        specache.EmbeddedDaemon(pool_bytes=64 << 20, chunk_bytes=0)
    assert info.value.code == StatusCode.INVALID_ARGUMENT
    with pytest.raises(StatusError) as info:  # its rounding to whole chunks used to wrap to 0
        specache.EmbeddedDaemon(pool_bytes=(1 << 64) - 1, chunk_bytes=16 << 20)
    assert info.value.code == StatusCode.INVALID_ARGUMENT
    assert "whole chunks" in str(info.value)


def test_source_over_its_session_quota(daemon):
    client = specache.Client.connect(daemon.socket)
    session = client.open_session("default", 16 << 20)
    source = specache.DaemonSource(session, page_tokens=64, capacity_tokens=1 << 16)
    shape = specache.ModelShape(8, 8, 8, 128)  # 8 layers x 8 heads x 64 tokens x 512 B = 2 MiB a page
    agent = specache.Agent(shape, specache.KvConfig("full"), source)
    agent.add_sequence(1)
    import numpy as np

    n = 64 * 9  # 9 pages per layer: more than the session's 16 MiB
    q = np.zeros((n, 8, 128), np.float32)
    with pytest.raises(StatusError) as info:
        agent.prefill_layer(0, [1], [0, n], q, q, q, np.zeros_like(q))
    assert info.value.code == StatusCode.RESOURCE_EXHAUSTED


def test_embedded_daemon_stops(daemon):
    assert daemon.running
    socket = daemon.socket
    daemon.stop()
    assert not daemon.running
    with pytest.raises(StatusError) as info:
        specache.Client.connect(socket, deadline_ms=300)
    assert info.value.code == StatusCode.UNAVAILABLE


def test_kept_sequence_is_claimed_back_by_a_later_session(daemon):
    client = specache.Client.connect(daemon.socket)
    layout = dict(n_layers=2, n_kv_heads=2, head_dim=64, capacity_tokens=256)
    session = client.open_session("default", 16 << 20)
    seq = session.create_sequence(**layout)
    assert session.extend(seq, 100) == 2
    session.keep(seq)
    del session  # its end parks the kept sequence for the tenant
    import time

    for _ in range(100):
        if any(s["id"] == seq for s in client.list_sequences()):
            break
        time.sleep(0.05)
    later = client.open_session("default", 16 << 20)
    with pytest.raises(StatusError) as info:  # another layout: refused, and it stays kept
        later.claim(seq, **dict(layout, head_dim=128))
    assert info.value.code == StatusCode.FAILED_PRECONDITION
    assert later.claim(seq, **layout) == 2
    assert later.pages_per_layer(seq) == 2
