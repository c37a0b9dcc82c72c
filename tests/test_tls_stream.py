"""The encrypted data stream (``tcp-data-tls-v1``, SPEC §18.7) with real nodes and sockets.

What is held: CurveZMQ nodes move their blocks on a TLS 1.3 stream whose server
certificate the (encrypted) welcome pins, byte for byte what ZeroMQ moves, and never on
a plaintext one; a man in the middle that terminates TLS with a certificate of its own
is refused before the client says a word, so the token never reaches it, and the blocks
stay on CurveZMQ; a welcome that pins another certificate is refused the same way; a
client that speaks no TLS to the data port, or presents a token that was never offered
inside TLS, is closed unanswered, and the pool is untouched; several streams are each
TLS.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

import pytest
import zmq
from internals import break_data_port_pin, inbound_connections, stream_socket
from nodeproc import fill, moves_both_ways
from nodeproc import pooled_node as node
from rawpeer import Acceptor, ThrottlingProxy, ipv6_loopback, wait_until

from p2pkv import protocol as proto
from p2pkv.node import KeyOutcome, Node
from p2pkv.transport import CurveKeys
from p2pkv.transport.tls import ServerTLS, client_context

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE"),
]

SEED_V1 = {"layout": "v1", "geometry": "seed"}


def curve_pair(made: list[Any], **config: Any) -> tuple[Node, Node]:
    """Two CURVE nodes whose streams are TLS (``data_encryption`` "tls"; the default
    "sealed" prefers tcp-data-aead-v1, tests/test_sealed_stream.py)."""
    config.setdefault("data_encryption", "tls")
    spub, ssec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    producer = node({**SEED_V1, "pool": 80}, curve=CurveKeys(spub, ssec), **config)
    consumer = node({**SEED_V1, "pool": 80}, curve=CurveKeys(cpub, csec, spub), **config)
    made += [producer, consumer]
    return producer, consumer


def test_curve_nodes_move_blocks_on_a_pinned_tls_stream(made: list[Any]) -> None:
    producer, consumer = curve_pair(made)
    assert proto.CAP_TCP_DATA_TLS_V1 in producer.hello.caps
    assert proto.CAP_TCP_DATA_V1 not in producer.hello.caps  # never a plaintext stream
    assert proto.CAP_TCP_DATA_AEAD_V1 not in producer.hello.caps
    keys = fill(producer, 24)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp-data", peer.data_path_detail
    assert "TLS 1.3, its certificate pinned" in peer.data_path_detail
    moves_both_ways(producer, consumer, peer, keys)


def test_several_tls_streams(made: list[Any]) -> None:
    producer, consumer = curve_pair(made, data_streams=3)
    keys = fill(producer, 30)
    peer = consumer.connect(producer.address)
    assert peer.data_path_detail.startswith("3 data streams"), peer.data_path_detail
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)
    (inbound,) = inbound_connections(producer)
    assert sorted(inbound.streams) == [0, 1, 2]
    assert all(isinstance(stream_socket(s), ssl.SSLSocket) for s in inbound.streams.values())


class TlsMitm(Acceptor):
    """A man in the middle of the data port: it terminates TLS with a certificate of its
    own, opens TLS to the real port, and relays; it records what the client sent it."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        super().__init__(listen)
        self.upstream = upstream
        self.identity = ServerTLS()
        self.handshakes = 0
        self.received = bytearray()
        self.start()

    def serve(self, raw: socket.socket) -> None:
        raw.settimeout(5)
        try:
            client = self.identity.context.wrap_socket(raw, server_side=True)
            self.handshakes += 1
            upstream = client_context().wrap_socket(
                socket.create_connection(self.upstream, timeout=5))
            while data := client.recv(65536):
                self.received += data
                upstream.sendall(data)
        except (OSError, ssl.SSLError):
            pass
        finally:
            raw.close()


@pytest.mark.skipif(not ipv6_loopback(), reason="needs ::1")
def test_a_man_in_the_middle_of_the_data_port_is_refused_and_learns_nothing(
        made: list[Any]) -> None:
    producer, consumer = curve_pair(made)
    keys = fill(producer, 8)
    zport = int(producer.address.rsplit(":", 1)[1])
    dport = producer.stats().data_port
    assert dport is not None
    # ZeroMQ goes through a plain relay (CurveZMQ is end to end: it sees ciphertext);
    # the data port through the man in the middle, at the same port numbers on ::1.
    made.append(ThrottlingProxy(f"tcp://127.0.0.1:{zport}", 1e9, listen=("::1", zport)))
    mitm = TlsMitm(("::1", dport), ("127.0.0.1", dport))
    made.append(mitm)
    peer = consumer.connect(f"tcp://[::1]:{zport}")
    assert wait_until(lambda: mitm.handshakes == 1, timeout=5)
    assert peer.data_path == "tcp", peer.data_path_detail
    assert "not the one the welcome pinned" in peer.data_path_detail
    assert mitm.received == b""  # not even the preface: the token never reached it
    assert consumer.stats().data_pins_refused == 1
    # The blocks move on, on CurveZMQ.
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)
    assert consumer.stats().paths["stream"].blocks_received == 0


def test_a_welcome_that_pins_another_certificate_is_refused(made: list[Any]) -> None:
    producer, consumer = curve_pair(made)
    # What the welcome pins from now on: not its certificate.
    break_data_port_pin(producer, bytes(32))
    keys = fill(producer, 4)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp"
    assert "not the one the welcome pinned" in peer.data_path_detail
    assert consumer.stats().data_pins_refused == 1
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)


def _closed_unanswered(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True
    finally:
        sock.close()


def test_no_tls_or_a_token_never_offered_is_closed_unanswered(made: list[Any]) -> None:
    producer, consumer = curve_pair(made)
    keys = fill(producer, 4)
    dport = producer.stats().data_port
    assert dport is not None
    # A plaintext preface to the TLS port: not a TLS handshake, closed unanswered.
    plain = socket.create_connection(("127.0.0.1", dport), timeout=5)
    plain.sendall(proto.preface(bytes(16)))
    assert _closed_unanswered(plain)
    # TLS, but a token no welcome offered: closed unanswered inside TLS.
    tls = client_context().wrap_socket(socket.create_connection(("127.0.0.1", dport),
                                                                timeout=5))
    tls.sendall(proto.preface(bytes(16)))
    assert _closed_unanswered(tls)
    assert wait_until(lambda: producer.stats().data_streams_refused == 2, timeout=5)
    # The node is fine, and its pool untouched.
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp-data"
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)
    assert producer.store.stats().pinned == 0
