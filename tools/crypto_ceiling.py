"""What encrypting a stream costs on this machine, with no p2pkv in the way.

    python tools/crypto_ceiling.py [--gib 1] [--rounds 3]

Three streams, each a sender process writing 1 MiB buffers to a receiver over loopback
TCP, alternating, the best of ``--rounds``:

- ``plain``: a plain socket, ``recv_into`` one 8 MiB buffer;
- ``tls``: the same through Python's ``ssl`` (TLS 1.3, the node's own ephemeral
  certificate and contexts from :mod:`p2pkv.transport.tls`), the receiver calling
  ``recv_into`` (one TLS record, 16 KiB at most, per call);
- ``sealed``: the same through the sealed stream's socket
  (:class:`p2pkv.transport.sealed.SealedSocket`, ``tcp-data-aead-v1``): 1 MiB AES-256-GCM
  records sealed straight from the sender's buffer and opened straight into the
  receiver's;

and the AES-256-GCM decryption of 16 KiB records by ``cryptography``'s AESGCM (its own
OpenSSL) alone. The TLS/plain ratio is the ceiling of any stream that encrypts with
Python's ``ssl`` here: the bench row ``CURVE + TLS data stream ... vs plaintext stream``
cannot beat it. The AESGCM figure is what the cipher itself costs.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import ssl
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pkv.protocol.seal import RecordKeys
from p2pkv.transport.sealed import SealedSocket
from p2pkv.transport.tls import ServerTLS, client_context


def _sealed_send(sock: SealedSocket, buf: memoryview) -> None:
    while buf.nbytes:
        try:
            buf = buf[sock.send_records([buf]):]
        except BlockingIOError:
            select.select([], [sock], [], 60)


def _sealed_receive(sock: SealedSocket, dst: memoryview) -> int:
    got = 0
    while True:
        try:
            n = sock.recv_records([dst])
        except BlockingIOError:
            select.select([sock], [], [], 60)
            continue
        if n == 0:
            return got
        got += n


def stream(nbytes: int, mode: str) -> tuple[float, float]:
    """(GB/s, receiver CPU s per GB) of one run."""
    tls = mode == "tls"
    sealed = mode == "sealed"
    secret, token = os.urandom(32), os.urandom(16)
    server = ServerTLS() if tls else None
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        pid = os.fork()
        if pid == 0:  # the sender
            try:
                out: socket.socket = socket.create_connection(("127.0.0.1", port), timeout=60)
                if tls:
                    out = client_context().wrap_socket(out)
                buf = memoryview(os.urandom(1 << 20))
                if sealed:
                    out = SealedSocket(out, sealer=RecordKeys(secret, token, "server"))
                for _ in range(nbytes >> 20):
                    if sealed:
                        _sealed_send(out, buf)  # type: ignore[arg-type]
                    else:
                        out.sendall(buf)
                # Half-close, then read (raw, past TLS) until the receiver closes: closing
                # with its session tickets unread would reset the connection, and the
                # receiver would lose what it had not read yet.
                out.setblocking(True)
                socket.socket.shutdown(out, socket.SHUT_WR)
                while socket.socket.recv(out, 65536):
                    pass
                out.close()
            finally:
                os._exit(0)
        conn, _ = listener.accept()
        conn.settimeout(60)
        if server is not None:
            conn = server.context.wrap_socket(conn, server_side=True)
        dst = memoryview(bytearray(8 << 20))
        got = 0
        t0, c0 = time.perf_counter(), time.thread_time()
        if sealed:
            conn = SealedSocket(conn, opener=RecordKeys(secret, token, "server"))
            got = _sealed_receive(conn, dst)
        while not sealed:
            try:
                n = conn.recv_into(dst)
            except (ConnectionResetError, ssl.SSLEOFError):
                n = 0
            if n == 0:
                break
            got += n
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        conn.close()
        os.waitpid(pid, 0)
    if got != nbytes:
        raise SystemExit(f"received {got} of {nbytes} bytes")
    return got / wall / 1e9, cpu / (got / 1e9)


def aesgcm_seconds_per_gb(records: int = 65536) -> float:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(AESGCM.generate_key(256))
    nonce, plain = os.urandom(12), os.urandom(16384)
    sealed = aead.encrypt(nonce, plain, None)
    out = bytearray(len(plain))
    t0 = time.perf_counter()
    for _ in range(records):
        aead.decrypt_into(nonce, sealed, None, out)
    return (time.perf_counter() - t0) / (records * len(plain) / 1e9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB per run")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30)) >> 20 << 20
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for name in ("plain", "tls", "sealed"):
            gbps, cpu = stream(nbytes, name)
            if name not in best or gbps > best[name][0]:
                best[name] = (gbps, cpu)
    print(f"Python {sys.version.split()[0]}, {ssl.OPENSSL_VERSION}")
    for name, (gbps, cpu) in best.items():
        print(f"{name:6s} {gbps:6.2f} GB/s   receiver CPU {cpu:.3f} s per GB")
    print(f"tls / plain: {best['tls'][0] / best['plain'][0]:.2f}x")
    print(f"sealed / plain: {best['sealed'][0] / best['plain'][0]:.2f}x")
    print(f"AES-256-GCM decrypt_into, 16 KiB records (cryptography): "
          f"{aesgcm_seconds_per_gb():.3f} s per GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
