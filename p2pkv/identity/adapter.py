"""What identifies a LoRA adapter, and how it enters a block key: the content of its files.

An engine computes the K/V of a request under an adapter with the adapter's weights
added to the base model's projections, so that KV is only interchangeable between
engines that apply the *same adapter content*. Engines name adapters by a name, an
integer id and a path, and vLLM's block hashes carry the name and the path, never the
content. During a rolling update two hosts hold different files under the same name and
path, compute equal keys, and would exchange KV that is not interchangeable.

p2pkv therefore knows an adapter by a digest of its files, :func:`adapter_identity`:

- ``adapter_config.json`` (rank, alpha, target modules, scaling options: each changes
  the values the adapter adds) and every weight file beside it (``*.safetensors``,
  ``*.bin``, ``*.pt``: ``adapter_model.*`` and ``new_embeddings.*``), each by name, size
  and SHA-256, in one canonical manifest;
- file digests come from the same digest cache as the checkpoint's weights
  (:func:`~p2pkv.identity.checkpoint.file_digests`): by real path, size, mtime, ctime,
  inode and device, so a file rewritten in place is hashed again and a restart reads
  nothing twice.

:func:`adapter_key` then salts a block key with that digest: the key of a chunk
computed under an adapter is a function of the adapter's content, so two engines whose
adapters differ in any byte never compute the same key, and a mismatch is a miss. Keys
of requests without an adapter are left as they are.

Reads files; nothing imports it at package import time.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from p2pkv.identity.checkpoint import (
    CheckpointError,
    FileDigest,
    digest_cache_path,
    file_digests,
    readable_files,
)
from p2pkv.identity.runconfig import FINGERPRINT_HEX_LEN, canonical_json

__all__ = ["ADAPTER_CONFIG", "AdapterError", "AdapterIdentity", "adapter_files",
           "adapter_identity", "adapter_key", "adapter_name_key", "adapter_signature"]

ADAPTER_CONFIG: Final = "adapter_config.json"
#: The files beside the config that hold tensors an engine may load for the adapter.
ADAPTER_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt")
#: Bytes at the end of a vLLM offload key that are not the block hash: its KV-cache
#: group index, 4 bytes big-endian. A salted key keeps them, and its length.
GROUP_SUFFIX_BYTES: Final = 4
_CONTENT_DOMAIN: Final = b"p2pkv adapter content v1\x00"
_NAME_DOMAIN: Final = b"p2pkv adapter name v1\x00"


class AdapterError(CheckpointError):
    """An adapter whose files cannot be found or read: its requests are not shared."""


@dataclass(frozen=True)
class AdapterIdentity:
    """One adapter's content digest, its files, and how long finding it took."""

    path: str
    #: 16 hex: SHA-256 of the canonical JSON manifest of the adapter's files.
    digest: str
    files: tuple[FileDigest, ...]
    seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def describe(self) -> str:
        sources = sorted({f.source for f in self.files})
        return (f"adapter {self.digest}: SHA-256 of {len(self.files)} file(s), "
                f"{self.total_bytes / 1e6:.1f} MB ({', '.join(sources)}; "
                f"{self.seconds * 1e3:.1f} ms)")


def adapter_files(path: str | os.PathLike[str]) -> list[tuple[Path, os.stat_result]]:
    """The files that define the adapter at ``path`` (a directory), with their stat;
    raises :class:`AdapterError` when the config or every weight file is missing, or a
    file cannot be read."""
    root = Path(path)
    try:
        if not root.is_dir():
            raise AdapterError(f"adapter path {str(root)!r} is not a directory here")
        entries = sorted(p for p in root.iterdir()
                         if not p.name.startswith(".") and p.is_file())
    except OSError as exc:
        raise AdapterError(f"cannot list the adapter {str(root)!r}: {exc}") from None
    config = [p for p in entries if p.name == ADAPTER_CONFIG]
    weights = [p for p in entries if p.name.endswith(ADAPTER_WEIGHT_SUFFIXES)]
    if not config or not weights:
        missing = ADAPTER_CONFIG if not config else "a weight file (*.safetensors, *.bin)"
        raise AdapterError(f"adapter {str(root)!r} has no {missing}: its content "
                           "cannot be hashed, so its requests are not shared")
    return readable_files(config + weights, what="adapter file", error=AdapterError)


def adapter_identity(path: str | os.PathLike[str], *,
                     cache: Path | None = None) -> AdapterIdentity:
    """Hash the adapter at ``path`` (blocking; cached files cost a ``stat``). Raises
    :class:`AdapterError`."""
    started = time.perf_counter()
    files = adapter_files(path)
    try:
        digests = file_digests(files, cache=digest_cache_path() if cache is None else cache)
    except CheckpointError as exc:
        raise AdapterError(str(exc)) from None
    entries = tuple(FileDigest(name=file.name, size=st.st_size, sha256=sha, source=source)
                    for (file, st), (sha, source) in zip(files, digests, strict=True))
    manifest = sorted(({"name": f.name, "sha256": f.sha256, "size": f.size}
                       for f in entries), key=lambda entry: str(entry["name"]))
    digest = hashlib.sha256(canonical_json({"adapter_files": manifest}).encode()
                            ).hexdigest()[:FINGERPRINT_HEX_LEN]
    return AdapterIdentity(path=str(path), digest=digest, files=entries,
                           seconds=time.perf_counter() - started)


def adapter_signature(path: str | os.PathLike[str]
                      ) -> tuple[tuple[str, int, int, int, int], ...] | None:
    """Name, size, mtime, ctime and inode of every file in the adapter's directory: one
    directory scan, so that a caller can reuse a digest while the signature is equal.
    None when the directory cannot be read."""
    try:
        with os.scandir(path) as entries:
            out = []
            for entry in entries:
                if entry.name.startswith(".") or not entry.is_file():
                    continue
                st = entry.stat()
                out.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                            st.st_ino))
    except OSError:
        return None
    return tuple(sorted(out))


def _salted(domain: bytes, salt: bytes, key: bytes) -> bytes:
    if len(key) <= GROUP_SUFFIX_BYTES:
        raise ValueError(f"a block key of {len(key)} bytes has no hash to salt")
    body, group = key[:-GROUP_SUFFIX_BYTES], key[-GROUP_SUFFIX_BYTES:]
    # SHA-256 of the domain, the salt and the engine's own key, cut to the key's length:
    # as collision-free as the engine's hash for keys up to 32 bytes of hash.
    salted = hashlib.sha256(domain + len(salt).to_bytes(2, "big") + salt + body).digest()
    if len(body) > len(salted):
        salted += hashlib.sha256(b"\x01" + salted).digest()
    return salted[:len(body)] + group


def adapter_key(digest: str, key: bytes) -> bytes:
    """``key`` (an engine block key ending in its 4-byte group index) salted with an
    adapter's content digest: same length, same group index, a function of both."""
    return _salted(_CONTENT_DOMAIN, digest.encode("ascii"), key)


def adapter_name_key(name: str, path: str, key: bytes) -> bytes:
    """``key`` salted with an adapter's name and path only (not its content). Never a
    key KV is loaded under: a holder of it marks that some engine computed this prefix
    under an adapter of that name and path, which tells an adapter whose content
    differs (a rolling update) from a prefix nobody holds."""
    return _salted(_NAME_DOMAIN, f"{name}\x00{path}".encode(), key)
