"""CURVE transport security and the connect allowlist (issue 8).

Keys come from the real CLI (``p2pkv-node keygen DIR --name NAME``, zmq.auth format).
A server node with ``CurveKeys(server_pub, server_sec, None, {authorized client pubs})``
accepts an authorized client (byte-exact fetch) and rejects an unauthorized key and a
plaintext client within the handshake timeout: the ZeroMQ security handshake fails,
which the socket monitor reports, and the client raises TransportHandshakeFailed saying
what happened (never a PeerIncompatible without reasons). ``probe`` prints it and exits
6 (issue 11).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from nodeproc import content, keys_for
from rawpeer import FakeServer, RawPeer, SilentRouter, raw_hello

from p2pkv.bench.ports import free_port
from p2pkv.errors import (
    ConfigError,
    P2PKVError,
    PeerIncompatible,
    ProtocolError,
    TransportHandshakeFailed,
)
from p2pkv.protocol import Code, Refuse, encode
from p2pkv.transport import CurveKeys, load_authorized_keys

pytestmark = pytest.mark.timeout(120)

SMALL = {"layout": "v2", "geometry": "small"}
BLOCKS = 6
# Scheduling slack on a busy 2-core machine; the bounds only show that nothing hangs.
SLACK = 5.0


def keygen(directory: Path, name: str) -> tuple[bytes, bytes]:
    """Run the CLI's keygen; return (public, secret) as read back with zmq.auth."""
    script = Path(sys.executable).with_name("p2pkv-node")
    cmd = ([str(script)] if script.exists() else
           [sys.executable, "-c", "import sys; from p2pkv.cli import main; sys.exit(main())"])
    done = subprocess.run([*cmd, "keygen", str(directory), "--name", name],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    public_file = directory / f"{name}.key"
    secret_file = directory / f"{name}.key_secret"
    assert public_file.is_file() and secret_file.is_file()
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    public, none = zmq.auth.load_certificate(str(public_file))
    assert none is None  # the public file holds no secret
    pub2, secret = zmq.auth.load_certificate(str(secret_file))
    assert pub2 == public and secret is not None and len(public) == len(secret) == 40
    return public, secret


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[bytes, bytes]]:
    base = tmp_path_factory.mktemp("curve")
    out = {name: keygen(base / ("clients" if name.startswith("client") else "other"), name)
           for name in ("server", "client1", "client2", "stranger")}
    # load_authorized_keys reads every *.key in a directory (the two clients here).
    assert load_authorized_keys(base / "clients") == frozenset(
        {out["client1"][0], out["client2"][0]})
    return out


def curve_server(nodes: Any, keys: dict[str, tuple[bytes, bytes]]) -> Any:
    spub, ssec = keys["server"]
    authorized = frozenset({keys["client1"][0], keys["client2"][0]})
    server = nodes({**SMALL, "blocks": BLOCKS}, handshake_timeout=1.5,
                   curve=CurveKeys(spub, ssec, None, authorized))
    for k in keys_for(BLOCKS):
        server.put(k, content(k, server.layout.bytes_per_block))
    return server


def client_curve(keys: dict[str, tuple[bytes, bytes]], name: str) -> CurveKeys:
    pub, sec = keys[name]
    return CurveKeys(pub, sec, keys["server"][0], None)


@pytest.mark.parametrize("who", ["client1", "client2"])
def test_authorized_client_fetches_byte_exact(nodes: Any, keys: Any, who: str) -> None:
    server = curve_server(nodes, keys)
    client = nodes({**SMALL, "blocks": BLOCKS}, curve=client_curve(keys, who))
    peer = client.connect(server.address)
    wanted = keys_for(BLOCKS)
    assert peer.lookup(wanted) == [True] * BLOCKS
    result = peer.fetch(wanted)
    assert result.stored == wanted
    size = client.layout.bytes_per_block
    assert all(client.get(k) == content(k, size) for k in wanted)
    assert server.stats().handshakes_accepted == 1


# What the client is told, by case: the kind of TransportHandshakeFailed and a phrase.
FAILURES = {
    "stranger": ("key-rejected", "did not accept this node's CURVE public key"),
    "plaintext": ("curve-required", "the server requires CurveZMQ"),
    "wrong-server-key": ("no-answer", "without an answer"),
}


@pytest.mark.parametrize("who", ["stranger", "plaintext", "wrong-server-key"])
def test_unauthorized_or_plaintext_client_cannot_handshake(
        nodes: Any, keys: Any, who: str) -> None:
    server = curve_server(nodes, keys)
    if who == "stranger":
        curve: CurveKeys | None = client_curve(keys, "stranger")
    elif who == "wrong-server-key":
        pub, sec = keys["client1"]
        curve = CurveKeys(pub, sec, keys["stranger"][0], None)
    else:
        curve = None
    # A long handshake deadline: the failure must be the security handshake's, reported
    # as soon as libzmq sees it, never the deadline (PeerTimeout) on a slow machine.
    client = nodes({**SMALL, "blocks": BLOCKS}, curve=curve, handshake_timeout=30.0)
    t0 = time.monotonic()
    with pytest.raises(P2PKVError) as info:
        client.connect(server.address)
    elapsed = time.monotonic() - t0
    assert elapsed < 30.0 - SLACK, f"took {elapsed:.2f}s"
    # The ZeroMQ security handshake fails and the node says which way, from the
    # monitor's events: a stranger's key is rejected by ZAP; a plaintext client speaks
    # the NULL mechanism; a server that cannot decrypt (wrong server key) hangs up.
    assert isinstance(info.value, TransportHandshakeFailed), repr(info.value)
    assert not isinstance(info.value, PeerIncompatible)
    kind, phrase = FAILURES[who]
    assert info.value.kind == kind, repr(info.value)
    assert phrase in str(info.value), str(info.value)
    assert client.peers() == []
    assert client.store.stats().used == 0
    assert server.stats().handshakes_accepted == 0
    # The server is unharmed: an authorized client still gets in.
    good = nodes({**SMALL, "blocks": BLOCKS}, curve=client_curve(keys, "client1"))
    assert good.connect(server.address).lookup(keys_for(2)) == [True, True]


def test_wrong_server_key_error_type_is_stable(nodes: Any, keys: Any) -> None:
    """The first connects race the CURVE failure against the hello being queued; the
    error type (and what it says happened) must not depend on who wins."""
    server = curve_server(nodes, keys)
    pub, sec = keys["client1"]
    kinds = []
    for _ in range(8):  # a fresh client node each time: the race shows on first connects
        client = nodes({**SMALL, "blocks": 2}, handshake_timeout=30.0,
                       curve=CurveKeys(pub, sec, keys["stranger"][0], None))
        with pytest.raises(P2PKVError) as info:
            client.connect(server.address)
        kinds.append(f"{type(info.value).__name__}:{getattr(info.value, 'kind', '')}")
    assert set(kinds) == {"TransportHandshakeFailed:no-answer"}, kinds


def test_curve_client_against_plaintext_server(nodes: Any, keys: Any) -> None:
    """The other mismatch: this side encrypts, the server does not."""
    server = nodes({**SMALL, "blocks": BLOCKS})
    client = nodes({**SMALL, "blocks": BLOCKS}, curve=client_curve(keys, "client1"),
                   handshake_timeout=30.0)
    with pytest.raises(TransportHandshakeFailed) as info:
        client.connect(server.address)
    assert info.value.kind == "curve-not-offered", repr(info.value)
    assert "the server speaks plaintext" in str(info.value)
    assert server.stats().handshakes_accepted == 0


def test_peer_incompatible_always_has_reasons(nodes: Any) -> None:
    with pytest.raises(ValueError, match="at least one reason"):
        PeerIncompatible("refused", reasons=[])
    # A peer that refuses without a compatibility reason (it found the hello malformed)
    # is a protocol failure with its code, not an incompatibility with no reasons.
    client = nodes(SMALL, handshake_timeout=30.0)
    server = FakeServer(client.hello)
    local = client.hello
    server.welcome = Refuse(Code.UNEXPECTED, "hello not understood", (), "fake-server",
                            local.rc, local.fp, local.geo, local.khash)  # type: ignore[assignment]
    try:
        with pytest.raises(ProtocolError) as info:
            client.connect(server.address)
        assert info.value.code == Code.UNEXPECTED
        assert "hello not understood" in str(info.value)
        assert not isinstance(info.value, PeerIncompatible)
    finally:
        server.close()


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("p2pkv-node")
    cmd = ([str(script)] if script.exists() else
           [sys.executable, "-c", "import sys; from p2pkv.cli import main; sys.exit(main())"])
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("who", ["stranger", "plaintext"])
def test_probe_reports_a_failed_transport_handshake(
        nodes: Any, keys: Any, tmp_path: Path, who: str) -> None:
    """As an operator tries it: probe a CURVE server with an unauthorized key, or in
    plaintext. It says what happened (no empty refusal table) and exits 6."""
    server = curve_server(nodes, keys)
    # The probe uses the identity of the nodes under test (nodeproc's "small" geometry).
    identity = ["--model", "test/model", "--layers", "4", "--kv-heads", "2", "--head-dim", "16",
                "--handshake-timeout", "20"]
    curve_args: list[str] = []
    if who == "stranger":
        base = tmp_path / "keys"
        keygen(base, "stranger")
        server_key = base / "server.key"
        server_key.write_text(
            "metadata\ncurve\n    public-key = \"" + keys["server"][0].decode() + "\"\n")
        curve_args = ["--curve-secret-key", str(base / "stranger.key_secret"),
                      "--curve-server-key", str(server_key)]
    done = run_cli("probe", server.address, *identity, *curve_args)
    assert done.returncode == 6, (done.returncode, done.stdout, done.stderr)
    assert "TRANSPORT HANDSHAKE FAILED" in done.stdout, done.stdout
    assert FAILURES[who][1] in done.stdout, done.stdout
    assert "REFUSED" not in done.stdout and "FIELD" not in done.stdout
    done = run_cli("probe", server.address, *identity, *curve_args, "--json")
    assert done.returncode == 6, (done.stdout, done.stderr)
    verdict = json.loads(done.stdout)
    assert verdict["verdict"] == "transport-handshake-failed", verdict
    assert verdict["kind"] == FAILURES[who][0] and verdict["address"] == server.address


def test_plaintext_raw_socket_never_reaches_the_protocol(nodes: Any, keys: Any) -> None:
    """A raw plaintext DEALER sends a hello: the NULL/CURVE mechanism mismatch fails the
    ZMTP handshake, libzmq drops the connection, the node never sees a p2pkv message."""
    server = curve_server(nodes, keys)
    raw = RawPeer(server.address, monitor=True)
    try:
        with contextlib.suppress(zmq.Again):  # no pipe once the handshake has failed
            raw.send([bytes(f) for f in encode(raw_hello(server))], timeout=0.2)
        events = raw.monitor_events(10.0)
        assert zmq.EVENT_DISCONNECTED in events or zmq.EVENT_CLOSED in events, events
        # A full round trip of an authorized client afterwards: the node has handled
        # everything the raw socket could have delivered, and counted none of it.
        good = nodes({**SMALL, "blocks": BLOCKS}, curve=client_curve(keys, "client1"))
        assert good.connect(server.address).lookup(keys_for(2)) == [True, True]
        assert server.stats().handshakes_accepted == 1
        assert server.stats().protocol_violations == 0
        assert raw.nothing_within(0)
    finally:
        raw.close()


def test_connect_allowlist_refuses_before_any_connection(nodes: Any) -> None:
    """ConfigError at call time, and not a single TCP connection is attempted."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.5)
    forbidden = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    allowed_router = SilentRouter()
    try:
        node = nodes(SMALL, handshake_timeout=0.5,
                     connect_allowlist=frozenset({allowed_router.address}))
        with pytest.raises(ConfigError) as info:
            node.connect(forbidden)
        assert forbidden in str(info.value)
        with pytest.raises(ConfigError):
            node.connect_async(f"tcp://127.0.0.1:{free_port()}")
        with pytest.raises(TimeoutError):  # socket.timeout: nobody knocked
            listener.accept()
        assert node.peers() == []
        # An allowed address is attempted (here: it times out, nobody answers).
        with pytest.raises(P2PKVError) as info2:
            node.connect(allowed_router.address)
        assert not isinstance(info2.value, ConfigError)
    finally:
        listener.close()
        allowed_router.close()
