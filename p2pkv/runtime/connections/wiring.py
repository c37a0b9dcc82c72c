"""A node's runtime, put together: sockets, counters, the IO thread and its participants.

:func:`wire` builds, in one place, everything behind the :class:`~p2pkv.node.Node`
facade and hands it back as a :class:`Runtime`: the ZeroMQ context with its CURVE
authenticator and ROUTER, the data port, the counters, the reactor, the serving side
(:class:`~p2pkv.runtime.connections.server.Server`: the ROUTER's peers, their senders and data
paths) and the fetching side (:class:`~p2pkv.runtime.connections.client.Client`: the connections
this node opens, their landings and data paths). The node starts the reactor once it
holds the result. On a failure while binding, nothing is left open.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import zmq

from p2pkv import protocol as proto
from p2pkv.protocol.codes import MAX_HEAD_BYTES
from p2pkv.runtime.config import NodeConfig
from p2pkv.runtime.connections.client import Client
from p2pkv.runtime.connections.inbound import InboundParts
from p2pkv.runtime.connections.outbound import OutboundParts
from p2pkv.runtime.connections.server import Server
from p2pkv.runtime.paths.data_client import DataReceiver
from p2pkv.runtime.paths.data_sender import DataSender
from p2pkv.runtime.paths.data_server import DataListener
from p2pkv.runtime.paths.landing import Landing
from p2pkv.runtime.paths.nixl_client import NixlPool, NixlReceiver
from p2pkv.runtime.paths.receiver import Receiver
from p2pkv.runtime.paths.sender import Sender
from p2pkv.runtime.paths.shm_client import SharedReceiver
from p2pkv.runtime.paths.shm_server import SharedSender
from p2pkv.runtime.public import PeerOwner
from p2pkv.runtime.reactor import Reactor
from p2pkv.runtime.stats import Counters
from p2pkv.store import BlockStore
from p2pkv.transport import (
    bound_address,
    datachannel,
    make_dealer,
    make_router,
    start_authenticator,
)
from p2pkv.transport.tls import ServerTLS

__all__ = ["Runtime", "deadlines_of", "wire"]


@dataclass(frozen=True, eq=False)
class Runtime:
    """What a node's facade holds of its runtime."""

    ctx: zmq.Context[zmq.Socket[bytes]]
    #: The CURVE authenticator (None without CURVE).
    auth: Any
    #: Where the ROUTER is bound (``tcp://host:port``).
    address: str
    counters: Counters
    reactor: Reactor
    client: Client
    server: Server
    inbound: InboundParts
    shm_sender: SharedSender
    data_listener: DataListener | None
    #: The largest frame the node's sockets take (libzmq drops a connection that
    #: sends a larger one before Python sees it).
    max_message: int


def deadlines_of(config: NodeConfig) -> proto.Deadlines:
    """The session deadlines a node's configuration asks for."""
    return proto.Deadlines(
        handshake=config.handshake_timeout,
        lookup=config.lookup_timeout,
        fetch_idle=config.fetch_idle_timeout,
        abort=config.abort_timeout,
        heartbeat_interval=config.heartbeat_interval,
        heartbeat_timeout=config.heartbeat_timeout,
    )


def _bind(ctx: zmq.Context[zmq.Socket[bytes]], config: NodeConfig, max_message: int,
          data: bool) -> tuple[Any, zmq.Socket[bytes], socket.socket | None]:
    """The node's listening sockets: its CURVE authenticator (None without CURVE), its
    ROUTER, and its data port (tcp-data-v1, where the ROUTER listens; None when it
    offers no data channel). On failure nothing is left open, the context is ended."""
    auth: Any = None
    router: zmq.Socket[bytes] | None = None
    try:
        if config.curve is not None:
            # The authenticator must run before the socket binds so that no
            # connection slips through unauthenticated.
            auth = start_authenticator(ctx, config.curve)
        router = make_router(ctx, config.listen, max_message_bytes=max_message,
                             curve=config.curve)
        host = datachannel.host_of(bound_address(router))
        return auth, router, (datachannel.listen(host, config.data_port) if data else None)
    except BaseException:
        if router is not None:
            router.close(0)
        if auth is not None:
            auth.stop()
        ctx.term()
        raise


def wire(config: NodeConfig, hello: proto.Hello, store: BlockStore, owner: PeerOwner, *,
         limits: proto.Limits, window: int, nixl: NixlPool | None = None) -> Runtime:
    """Build a node's runtime (not started). ``window``: the credit of one peer, in
    blocks; ``owner``: the node, which the peer handles call back; ``nixl``: its NIXL
    agents, when it offers nixl-v1."""
    segments = tuple(hello.geo.seg)
    bpb = hello.geo.bpb
    deadlines = deadlines_of(config)
    # libzmq drops any frame above this before Python sees it.
    max_message = max(max(segments), MAX_HEAD_BYTES)
    # Under CURVE every data stream is encrypted: sealed with keys from the session's
    # (encrypted) welcome, or TLS 1.3 with an ephemeral certificate of this node's, which
    # the welcome pins (made first: nothing is bound yet).
    tls = ServerTLS() if config.offers_data_channel and config.encrypts_data_stream else None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    auth, router, data_sock = _bind(ctx, config, max_message, config.offers_data_channel)
    address = bound_address(router)
    counters = Counters()
    reactor = Reactor(f"p2pkv-io-{address}")

    # The serving side. Only a node that opted in offers its segment; a pool shared by
    # the caller's store is offered too (the caller owns it and removes it).
    shm_sender = SharedSender(router, store, store.pool.segment if config.shm else None,
                              bpb, counters, pin_limit=2 * window,
                              nixl_nonce=None if nixl is None else nixl.exporter.nonce)
    nixl_offer = None if nixl is None else nixl.offer
    listener = None if data_sock is None else DataListener(
        reactor, data_sock, counters, timeout=config.handshake_timeout,
        max_pending=config.max_peers, tls=tls, sealed=config.seals_data_stream)
    inbound = InboundParts(router, store, Sender(router, store, bpb, counters), shm_sender,
                           counters, config.send_timeout, listener,
                           DataSender(store, segments, bpb, counters))
    cport = datachannel.port_of(address)
    server = Server(
        reactor, inbound,
        new_session=lambda now: proto.Session(
            proto.Role.SERVER, hello, deadlines=deadlines, limits=limits, now=now,
            identity_policy=config.identity_policy, shm_offer=shm_sender.offer,
            nixl_offer=nixl_offer,
            data_offer=None if listener is None else listener.offer(
                cport, now, config.data_streams)),
        max_peers=config.max_peers)

    # The fetching side: every way of landing settles through one Landing.
    landing = Landing(store, bpb, counters)
    client = Client(OutboundParts(
        reactor=reactor,
        dial=lambda peer: make_dealer(ctx, peer, max_message_bytes=max_message,
                                      curve=config.curve),
        new_session=lambda now: proto.Session(
            proto.Role.CLIENT, hello, deadlines=deadlines, limits=limits, now=now,
            identity_policy=config.identity_policy),
        hello=hello, owner=owner, store=store,
        receiver=Receiver(landing, segments, bpb, counters),
        shm=SharedReceiver(landing, segments, counters, proto.CreditBudget(window),
                           enabled=config.shm, threads=config.shm_copy_threads),
        data=DataReceiver(reactor, landing, segments, counters,
                          proto.CreditBudget(proto.stream_window(window)),
                          enabled=config.offers_data_channel, streams=config.data_streams),
        nixl=NixlReceiver(landing, segments, counters, proto.CreditBudget(window),
                          None if nixl is None else nixl.importer,
                          read_timeout=config.nixl_read_timeout,
                          proof_timeout=config.handshake_timeout,
                          threads=config.shm_copy_threads),
        budget=proto.CreditBudget(window),
        counters=counters,
        curve=config.curve is not None, bytes_per_block=bpb),
        max_peers=config.max_peers)
    # The order the IO loop serves them in, and the order they shut down in.
    reactor.add(client)
    reactor.add(server)
    return Runtime(ctx, auth, address, counters, reactor, client, server, inbound,
                   shm_sender, listener, max_message)
