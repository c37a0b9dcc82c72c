"""Transport: how node bytes move between processes, below the protocol.

* :mod:`p2pkv.transport.sockets`: ZeroMQ sockets (ROUTER/DEALER factories and options,
  monitors, the IO thread's wake-up pipe, address checks).
* :mod:`p2pkv.transport.curve`: CurveZMQ keys and the ZAP authenticator.
* :mod:`p2pkv.transport.datachannel`: plain TCP streams for bulk bytes (listener,
  dialing, ``sendmsg`` gather and ``recvmsg_into`` scatter), capability ``tcp-data-v1``.

Nothing here knows p2pkv messages; another data path (for example a same-host shared
memory one) belongs beside these modules.
"""

from __future__ import annotations

from p2pkv.transport.curve import CurveKeys, load_authorized_keys, start_authenticator
from p2pkv.transport.sockets import (
    Wakeup,
    bound_address,
    configure_common,
    cut_connection,
    handshake_failure,
    make_dealer,
    make_router,
    monitor_events,
    monitor_failure,
    monitor_messages,
    peer_of,
    validate_address,
)

__all__ = [
    "CurveKeys",
    "Wakeup",
    "bound_address",
    "configure_common",
    "cut_connection",
    "handshake_failure",
    "load_authorized_keys",
    "make_dealer",
    "make_router",
    "monitor_events",
    "monitor_failure",
    "monitor_messages",
    "peer_of",
    "start_authenticator",
    "validate_address",
]
