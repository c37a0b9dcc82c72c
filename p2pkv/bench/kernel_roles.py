"""Worker roles of the kernel's ceiling: plain TCP sockets, ``sendmsg`` gathering straight
from the sending pool's segments and ``recvmsg_into`` scattering straight into the
receiving pool's slots (one copy through the kernel on each side, nothing in Python
touches a payload byte). No framing beyond one 8-byte header per message, no flow
control, no checksums: what a data path cannot beat on this machine.

The pools are the bench's own (one region per segment, ``Dataset`` content, cold on the
receiver until the untimed warm-up round), and messages batch the same blocks per message
as the node does, so the rows compare like with like.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Any

from p2pkv.bench.data import BenchError, Dataset
from p2pkv.bench.raw_roles import RawBuffers, serve_ready
from p2pkv.workers import say, serve_commands

_HEADER = struct.Struct("<II")  # first block, blocks in this message
_REQUEST = struct.Struct("<HI")  # dataset name length, blocks wanted
#: Buffers per sendmsg/recvmsg call (Linux IOV_MAX is 1024; one is the header).
_IOV = 1000
_SOCK_BUF = 4 << 20


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise BenchError("kernel peer closed the connection")
        out += part
    return bytes(out)


def _send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """``sendmsg`` until every byte of ``buffers`` is out (gather, no copy in Python)."""
    while buffers:
        sent = sock.sendmsg(buffers[:_IOV])
        while sent:
            if sent >= len(buffers[0]):
                sent -= len(buffers[0])
                buffers.pop(0)
            else:
                buffers[0] = buffers[0][sent:]
                sent = 0


def _recv_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """``recvmsg_into`` until every buffer is full (scatter into the slots)."""
    while buffers:
        got = sock.recvmsg_into(buffers[:_IOV])[0]
        if got == 0:
            raise BenchError("kernel peer closed the connection mid-message")
        while got:
            if got >= len(buffers[0]):
                got -= len(buffers[0])
                buffers.pop(0)
            else:
                buffers[0] = buffers[0][got:]
                got = 0


def role_kernel_server(spec: dict[str, Any]) -> int:
    """The ceiling's sender: streams a dataset per request on each accepted socket."""
    datasets = {d["name"]: RawBuffers(Dataset(d["name"], d["segments"], d["blocks"]), True)
                for d in spec["datasets"]}
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = listener.getsockname()[:2]
    address = f"{host}:{port}"
    failure: list[str] = []

    def serve(conn: socket.socket) -> None:
        _tune(conn)
        try:
            with conn:
                while True:
                    head = conn.recv(_REQUEST.size, socket.MSG_WAITALL)
                    if len(head) < _REQUEST.size:
                        return
                    length, count = _REQUEST.unpack(head)
                    bufs = datasets[_recv_exactly(conn, length).decode()]
                    per, views = bufs.ds.per_message, bufs.views
                    for first in range(0, count, per):
                        nb = min(per, count - first)
                        out = [memoryview(_HEADER.pack(first, nb))]
                        for b in range(first, first + nb):
                            out.extend(views[b])
                        _send_all(conn, out)
        except Exception as exc:
            failure.append(f"{type(exc).__name__}: {exc}")

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        serve_ready(address, failure)
    finally:
        listener.close()
    return 0


def kernel_fetch_round(sock: socket.socket, bufs: RawBuffers, *,
                       clear: bool = False) -> tuple[float, int, float]:
    """One request for the whole dataset: seconds, bytes, this process's CPU seconds."""
    ds = bufs.ds
    if clear:
        bufs.clear()
    name = ds.name.encode()
    got = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    sock.sendall(_REQUEST.pack(len(name), ds.blocks) + name)
    while got < ds.blocks:
        first, nb = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
        if first != got or not 0 < nb <= ds.blocks - got:
            raise BenchError(f"kernel stream out of order: blocks {first}+{nb} at {got}")
        slots: list[memoryview] = []
        for b in range(first, first + nb):
            slots.extend(bufs.views[b])
        _recv_all(sock, slots)
        got += nb
    return time.perf_counter() - t0, got * ds.bpb, time.process_time() - cpu0


def role_kernel_client(spec: dict[str, Any]) -> int:
    """The ceiling's receiver: one connection, datasets fetched into cold pools."""
    buffers = {d["name"]: RawBuffers(Dataset(d["name"], d["segments"], d["blocks"]), False)
               for d in spec["datasets"]}
    host, _, port = spec["address"].rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    _tune(sock)
    sock.settimeout(60)
    try:
        say({"event": "ready", "pid": os.getpid()})

        def bulk(cmd: dict[str, Any]) -> dict[str, Any]:
            seconds, moved, cpu = kernel_fetch_round(sock, buffers[cmd["id"]],
                                                     clear=bool(cmd.get("clear")))
            return {"seconds": seconds, "bytes": moved, "cpu": cpu}

        def verify(cmd: dict[str, Any]) -> dict[str, Any]:
            good, bad = buffers[cmd["id"]].verify()
            return {"good": good, "bad": bad}

        serve_commands({"bulk": bulk, "verify": verify})
    finally:
        sock.close()
    return 0
