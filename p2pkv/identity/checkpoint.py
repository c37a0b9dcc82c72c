"""What a checkpoint on disk contributes to the identity: a content digest of its weight
files (``model_weights``) and a digest of its configuration file (``model_config``).

Two checkpoints with the same architecture, tensor names, shapes, dtypes and file sizes
(a re-download at another revision, a fine-tune or merge written in place, two clusters
naming their models alike) produce different K/V values for the same tokens. Nothing in
the run config can see that, so the identity hashes the bytes themselves.

Cost is kept off the engine's path three ways:

- a file inside a Hugging Face cache snapshot is a link to ``blobs/<sha256>``: the hub
  already hashed it, and its name is read instead of its bytes;
- every digest computed here is cached by the file's real path, size, mtime, ctime,
  inode and device (``$P2PKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/p2pkv``, else
  ``~/.cache/p2pkv``); a file replaced or rewritten in place changes its ctime, so a
  stale digest is never reused;
- files are hashed in parallel threads (``hashlib`` releases the GIL).

Unlike the rest of :mod:`p2pkv.identity`, this module reads files; nothing imports it at
package import time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from p2pkv.errors import P2PKVError
from p2pkv.identity.extension import canonical_model_overrides
from p2pkv.identity.runconfig import FINGERPRINT_HEX_LEN, canonical_json

__all__ = [
    "CheckpointError",
    "CheckpointIdentity",
    "FileDigest",
    "checkpoint_identity",
    "config_digest",
    "digest_cache_path",
    "file_digests",
    "hub_snapshot_revision",
    "modeling_code_digest",
    "readable_files",
    "readable_weight_files",
    "weight_files",
    "weights_digest",
]

#: Weight files in the order of preference of vLLM's ``load_format="auto"``: safetensors
#: when a directory has any, else PyTorch pickles, else GGUF.
WEIGHT_PATTERNS: Final = ((".safetensors",), (".bin", ".pt", ".pth"), (".gguf",))
#: Keys of ``config.json`` that describe the file, not the model: dropped before hashing
#: (the KV dtype is the run config's ``dtype``; the storage dtype of the weights is in
#: ``model_weights``).
CONFIG_METADATA_KEYS: Final = frozenset({
    "transformers_version", "torch_dtype", "dtype", "use_cache", "name_or_path",
})
_READ_CHUNK: Final = 8 << 20
_CACHE_FILE: Final = "checkpoint-digests.json"
_CACHE_MAX_ENTRIES: Final = 4096
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_cache_lock = threading.Lock()


class CheckpointError(P2PKVError, RuntimeError):
    """A checkpoint that cannot be identified: missing, unreadable, or without weights.

    Never caught into a "matching" identity: a node that cannot hash its weights does
    not share."""


@dataclass(frozen=True)
class FileDigest:
    """One weight file: its name in the checkpoint, size, SHA-256 and where that came
    from (``hashed``, ``cache`` or ``hf-blob``)."""

    name: str
    size: int
    sha256: str
    source: str


@dataclass(frozen=True)
class CheckpointIdentity:
    """The identity fields a checkpoint gives, with where each came from."""

    path: str
    #: 16 hex: SHA-256 of the canonical JSON manifest of the weight files.
    model_weights: str
    #: 16 hex digest of ``config.json`` without its metadata keys; None when the
    #: checkpoint has no ``config.json`` (a GGUF file carries its config inside).
    model_config: str | None
    files: tuple[FileDigest, ...]
    seconds: float
    #: The Hugging Face snapshot commit when the path is inside a hub cache snapshot.
    revision: str | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def digest_cache_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where computed file digests are cached."""
    env = os.environ if environ is None else environ
    if env.get("P2PKV_CACHE_DIR"):
        return Path(env["P2PKV_CACHE_DIR"]) / _CACHE_FILE
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "p2pkv" / _CACHE_FILE


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a checkpoint (a directory, or one ``.gguf``/``.safetensors``
    file), as the engine would load them; raises :class:`CheckpointError` when there are
    none or the path cannot be read."""
    root = Path(path)
    try:
        if root.is_file():
            return [root]
        if not root.is_dir():
            raise CheckpointError(f"model path {str(root)!r} does not exist (neither a "
                                  "checkpoint directory nor a weight file)")
        entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    except OSError as exc:
        raise CheckpointError(f"cannot list the checkpoint {str(root)!r}: {exc}") from None
    for suffixes in WEIGHT_PATTERNS:
        found = [p for p in entries if p.name.endswith(suffixes)]
        if found:
            return found
    wanted = ", ".join(f"*{s}" for group in WEIGHT_PATTERNS for s in group)
    raise CheckpointError(f"no weight files ({wanted}) in {str(root)!r}: p2pkv cannot "
                          "derive the model_weights identity of this checkpoint")


def readable_weight_files(path: str | os.PathLike[str]) -> list[tuple[Path, os.stat_result]]:
    """:func:`weight_files`, each opened and read one byte to prove it can be hashed."""
    return readable_files(weight_files(path))


def readable_files(files: Iterable[Path], *, what: str = "weight file",
                    error: type[CheckpointError] = CheckpointError
                    ) -> list[tuple[Path, os.stat_result]]:
    """Each file with its stat, each opened and read one byte to prove it can be hashed;
    ``error`` names the first that cannot be."""
    out = []
    for path in files:
        try:
            st = path.stat()
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise error(f"cannot read {what} {str(path)!r}: {exc}") from None
        out.append((path, st))
    return out


def _hf_blob_sha256(path: Path) -> str | None:
    """The SHA-256 a Hugging Face cache recorded for an LFS file: a snapshot entry is a
    link to ``../../blobs/<sha256>`` (git-sha1 names, 40 hex, are not content SHA-256)."""
    try:
        if not path.is_symlink():
            return None
        target = Path(os.readlink(path))
    except OSError:
        return None
    name = target.name
    if target.parent.name == "blobs" and _SHA256_RE.fullmatch(name):
        return name
    return None


def _cache_key(path: Path, st: os.stat_result) -> str:
    real = os.path.realpath(path)
    return (f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}|"
            f"{st.st_dev}")


def _load_cache(cache: Path) -> dict[str, str]:
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items()
            if isinstance(k, str) and isinstance(v, str) and _SHA256_RE.fullmatch(v)}


def _store_cache(cache: Path, new: Mapping[str, str]) -> None:
    """Merge ``new`` into the cache file (atomic replace; a lost race costs a rehash)."""
    if not new:
        return
    with _cache_lock, contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        merged = _load_cache(cache)
        merged.update(new)
        if len(merged) > _CACHE_MAX_ENTRIES:
            merged = dict(list(merged.items())[-_CACHE_MAX_ENTRIES:])
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".digests-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(merged, f, sort_keys=True)
            os.replace(tmp, cache)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    except OSError as exc:
        raise CheckpointError(f"cannot read weight file {str(path)!r}: {exc}") from None
    return h.hexdigest()


def _short(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX_LEN]


def weights_digest(files: Iterable[FileDigest]) -> str:
    """``model_weights`` (SPEC 1.4): 16 hex of the canonical JSON of the manifest
    ``{"files": [{"name", "sha256", "size"}, ...]}``, the files sorted by name."""
    manifest = sorted(({"name": f.name, "sha256": f.sha256, "size": f.size} for f in files),
                      key=lambda entry: str(entry["name"]))
    return _short(canonical_json({"files": manifest}))


def config_digest(config: Mapping[str, Any]) -> str:
    """``model_config``: 16 hex of the canonical form (SPEC 1.4) of a model configuration
    without :data:`CONFIG_METADATA_KEYS` and without keys starting with ``_``."""
    kept = {k: v for k, v in config.items()
            if k not in CONFIG_METADATA_KEYS and not k.startswith("_")}
    try:
        return _short(canonical_model_overrides(kept))
    except ValueError as exc:
        raise CheckpointError(f"config.json cannot be put in canonical form: {exc}") from None


def _read_config(root: Path) -> dict[str, Any] | None:
    path = root / "config.json"
    if not root.is_dir() or not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(path)!r} is not a JSON object")
    return data


def hub_snapshot_revision(path: str | os.PathLike[str]) -> str | None:
    """The commit of a Hugging Face cache snapshot (``.../snapshots/<commit>/...``)."""
    parts = Path(os.path.abspath(path)).parts
    for i in range(len(parts) - 1, 0, -1):
        if parts[i - 1] == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", parts[i]):
            return parts[i]
    return None


def file_digests(files: Iterable[tuple[Path, os.stat_result]], *, cache: Path,
                 threads: int | None = None) -> list[tuple[str, str]]:
    """The SHA-256 of each file and where it came from (``hf-blob``, ``cache`` or
    ``hashed``), in order: a Hugging Face blob name first, then the digest cache (by
    real path, size, mtime, ctime, inode and device), else the bytes, read in parallel
    threads. Digests computed here are added to the cache unless the file changed while
    it was read. Raises :class:`CheckpointError` for a file that cannot be read."""
    items = list(files)
    cached = _load_cache(cache)
    out: list[tuple[str, str] | None] = []
    todo: list[tuple[int, Path, str]] = []
    for i, (file, st) in enumerate(items):
        blob = _hf_blob_sha256(file)
        key = _cache_key(file, st)
        if blob is not None:
            out.append((blob, "hf-blob"))
        elif key in cached:
            out.append((cached[key], "cache"))
        else:
            out.append(None)
            todo.append((i, file, key))
    if todo:
        workers = max(1, min(len(todo), threads or min(8, os.cpu_count() or 1)))
        with concurrent.futures.ThreadPoolExecutor(workers, "p2pkv-hash") as pool:
            hashed = list(pool.map(lambda item: _sha256_file(item[1]), todo))
        fresh = {}
        for (i, file, key), sha in zip(todo, hashed, strict=True):
            out[i] = (sha, "hashed")
            # A file that changed while it was read is not cached under its old stat.
            with contextlib.suppress(OSError):
                if _cache_key(file, file.stat()) == key:
                    fresh[key] = sha
        _store_cache(cache, fresh)
    return [d for d in out if d is not None]


def modeling_code_digest(path: str | os.PathLike[str], *,
                         cache: Path | None = None) -> str | None:
    """16 hex of the manifest of the checkpoint's Python files (name, size, SHA-256),
    which define the model when the engine runs with ``trust_remote_code``; None when
    the checkpoint has none. Raises :class:`CheckpointError` for an unreadable one."""
    root = Path(path)
    if not root.is_dir():
        return None
    try:
        files = sorted(p for p in root.rglob("*.py")
                       if p.is_file() and not any(part.startswith(".")
                                                  for part in p.relative_to(root).parts))
    except OSError as exc:
        raise CheckpointError(f"cannot list the modeling code in {str(root)!r}: {exc}"
                              ) from None
    if not files:
        return None
    stats = readable_files(files, what="modeling code file")
    digests = file_digests(stats, cache=digest_cache_path() if cache is None else cache)
    manifest = [{"name": str(file.relative_to(root)), "sha256": sha, "size": st.st_size}
                for (file, st), (sha, _) in zip(stats, digests, strict=True)]
    return _short(canonical_json({"code": sorted(manifest, key=lambda e: str(e["name"]))}))


def checkpoint_identity(path: str | os.PathLike[str], *, cache: Path | None = None,
                        threads: int | None = None) -> CheckpointIdentity:
    """Hash a checkpoint's weight files and read its config (blocking; see the module
    docstring for what is reused instead of read). Raises :class:`CheckpointError`."""
    started = time.perf_counter()
    root = Path(path)
    files = readable_weight_files(root)
    cache_path = digest_cache_path() if cache is None else cache
    digests = dict(zip((f for f, _ in files),
                       file_digests(files, cache=cache_path, threads=threads), strict=True))
    base = root if root.is_dir() else root.parent
    entries = tuple(
        FileDigest(name=str(file.relative_to(base)), size=st.st_size,
                   sha256=digests[file][0], source=digests[file][1])
        for file, st in files)
    weights = weights_digest(entries)
    config = _read_config(root)
    seconds = time.perf_counter() - started
    revision = hub_snapshot_revision(root)
    sources = {
        "model_weights": _describe_weights(entries, seconds, cache_path),
        "model_config": ("config.json without its metadata keys" if config is not None
                         else "none: the checkpoint has no config.json"),
    }
    if revision is not None:
        sources["model_revision"] = "the Hugging Face cache snapshot the path is in"
    return CheckpointIdentity(
        path=str(root), model_weights=weights,
        model_config=None if config is None else config_digest(config),
        files=entries, seconds=seconds, revision=revision, sources=sources)


def _describe_weights(entries: tuple[FileDigest, ...], seconds: float, cache: Path) -> str:
    total = sum(e.size for e in entries)
    by_source: dict[str, int] = {}
    for e in entries:
        by_source[e.source] = by_source.get(e.source, 0) + 1
    how = {"hashed": "hashed now", "cache": f"from the digest cache {cache}",
           "hf-blob": "from the Hugging Face cache's blob names"}
    parts = ", ".join(f"{n} {how[s]}" for s, n in sorted(by_source.items()))
    return (f"SHA-256 of {len(entries)} weight file(s), {total / 1e6:.0f} MB ({parts}; "
            f"{seconds:.2f} s)")
