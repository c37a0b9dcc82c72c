"""TLS 1.3 for the data stream: a node's ephemeral certificate, pinned by its welcome.

Under CurveZMQ a data stream must be as private as the connection it sits beside
(SPEC §18.7). A node that serves encrypted streams makes, once at start, a fresh key
pair and a self-signed certificate that no one else ever holds (nothing is written to
disk but for the moment OpenSSL reads it, in a private directory). Its ``welcome``,
itself encrypted and authenticated by CurveZMQ, carries the SHA-256 of the certificate:
the client accepts the stream's TLS handshake only from a server presenting exactly that
certificate, and presents the session's token inside the TLS channel. A man in the
middle cannot show the pinned certificate, nor learn the token; one that only relays the
bytes sees nothing and can change nothing. The crypto runs in OpenSSL.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import ssl
import tempfile
from pathlib import Path

__all__ = ["ServerTLS", "client_context", "pin_matches"]


class ServerTLS:
    """A node's TLS identity for its data port: an ephemeral P-256 key and certificate,
    the server context that presents them, and their pin."""

    def __init__(self) -> None:
        # Imported here: only a node that serves encrypted streams needs it.
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                             f"p2pkv-{secrets.token_hex(8)}")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=3650))
                .sign(key, hashes.SHA256()))
        der = cert.public_bytes(serialization.Encoding.DER)
        #: What the welcome carries: the SHA-256 of the certificate (DER).
        self.pin = hashlib.sha256(der).digest()
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_3
        pem = (cert.public_bytes(serialization.Encoding.PEM)
               + key.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
        # load_cert_chain reads files only: a private directory, gone at once.
        with tempfile.TemporaryDirectory(prefix="p2pkv-tls-") as tmp:
            path = Path(tmp) / "identity.pem"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
            self.context.load_cert_chain(path)


def client_context() -> ssl.SSLContext:
    """The client's context: TLS 1.3, no certificate authority (the certificate is
    checked against the welcome's pin instead, :func:`pin_matches`), no host name."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def pin_matches(sock: ssl.SSLSocket, pin: bytes) -> bool:
    """Whether the server of a completed handshake presented the pinned certificate."""
    der = sock.getpeercert(binary_form=True)
    return der is not None and hmac.compare_digest(hashlib.sha256(der).digest(), pin)
