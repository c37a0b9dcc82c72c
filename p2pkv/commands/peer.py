"""``p2pkv-node probe`` and ``fetch``: a short-lived node that connects out to one node.

Both handshake first and say why when that fails: refused (the field-level table, exit
3), ZeroMQ's security handshake failed (exit 6: the peers never compared identities),
or unreachable (exit 4). ``probe`` then shows the peer's identity and the data path the
two would use, with any difference of the identity extensions that the handshake
accepted; ``fetch`` fetches fill blocks (``serve --fill``, SPEC appendix A) and checks
every byte against the fill rule (exit 5 on any mismatch).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from p2pkv.commands.common import (
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TRANSPORT,
    EXIT_UNREACHABLE,
    print_sources,
    settings_of,
)
from p2pkv.errors import (
    ConfigError,
    P2PKVError,
    PeerIncompatible,
    PeerTimeout,
    TransportHandshakeFailed,
)
from p2pkv.fill import MAX_FILL_BLOCKS, fill_keys, first_mismatch
from p2pkv.identity import extension_diff
from p2pkv.reports import reason_dict, refusal_table, remote_identity
from p2pkv.settings import Settings, node_config

__all__ = ["client_config", "cmd_fetch", "cmd_probe", "handshake", "unreachable"]


def client_config(settings: Settings, address: str) -> Any:
    """The node configuration of a command that only connects out (probe, fetch)."""
    from p2pkv.transport import validate_address

    try:
        validate_address(address, what="ADDRESS")
    except ConfigError as exc:
        raise ConfigError(f"ADDRESS: {exc}") from exc
    if settings["curve_secret_key"] is not None and settings["curve_server_key"] is None:
        raise ConfigError("--curve-server-key: connecting with CURVE needs the server's "
                          "public key file")
    # It only connects out: it never uses the configured --listen address (a shared TOML
    # file or P2PKV_LISTEN would name the serving node's port, already taken).
    return node_config(settings, listen="tcp://127.0.0.1:0")


def handshake(node: Any, args: argparse.Namespace, fingerprint: str,
               sources: dict[str, str] | None = None) -> Any:
    """Connect and handshake; on failure print the verdict and return its exit code.
    ``sources`` says where the local identity fields came from (shown with a refusal)."""
    try:
        return node.connect(args.address)
    except PeerIncompatible as exc:
        reasons = [reason_dict(r) for r in exc.reasons]
        if args.json:
            print(json.dumps({"verdict": "refused", "address": args.address,
                              "local_fingerprint": fingerprint,
                              "local_identity_sources": sources or {},
                              "remote": remote_identity(exc), "reasons": reasons},
                             sort_keys=True, default=str))
        else:
            print(f"REFUSED by handshake with {args.address}")
            remote = remote_identity(exc)
            if remote:
                print(f"remote node:        {remote.get('node')}")
                print(f"remote fingerprint: {remote.get('fp')}")
                if remote.get("ext", {}).get("engine"):
                    print(f"remote engine:      {remote['ext']['engine']}")
            print(f"local fingerprint:  {fingerprint}")
            print_sources({k: v for k, v in (sources or {}).items()
                            if any(r.field == f"ext.{k}" for r in exc.reasons)}, "local ")
            print(refusal_table(exc.reasons))
        return EXIT_REFUSED
    except TransportHandshakeFailed as exc:
        # Not a refusal: the peers never compared identities, there is no table.
        if args.json:
            print(json.dumps({"verdict": "transport-handshake-failed", "address": args.address,
                              "kind": exc.kind, "error": exc.detail}, sort_keys=True))
        else:
            print(f"TRANSPORT HANDSHAKE FAILED with {args.address} ({exc.kind}): {exc.detail}")
        return EXIT_TRANSPORT
    except (PeerTimeout, P2PKVError, OSError) as exc:
        # Any failure to reach the peer (timeout, refused or lost connection,
        # unresolvable host) is "unreachable", exit 4.
        unreachable(args, exc)
        return EXIT_UNREACHABLE


def unreachable(args: argparse.Namespace, exc: BaseException) -> None:
    if args.json:
        print(json.dumps({"verdict": "unreachable", "address": args.address,
                          "error": str(exc)}, sort_keys=True))
    else:
        print(f"UNREACHABLE {args.address}: {exc}")


def cmd_probe(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    config = client_config(settings, args.address)
    layout = settings.layout()
    rc = settings.run_config(layout)
    ext = settings.extension()
    from p2pkv.node import Node
    from p2pkv.protocol import Reason

    with Node(rc, layout, pool_blocks=1, config=config, extension=ext) as node:
        peer = handshake(node, args, rc.fingerprint, settings.identity_sources())
        if isinstance(peer, int):
            return peer
        # Accepted, yet the extensions may differ: a field only one side declares (under
        # the lenient policy) or another engine. Shown, never hidden.
        notes = [Reason(0, f"ext.{d.field}", d.local, d.remote, d.meaning)
                 for d in extension_diff(ext, peer.remote_extension, include_engine=True)]
        info = {"verdict": "compatible", "address": args.address,
                "remote_node": peer.remote_node_id, "fingerprint": peer.remote_fingerprint,
                "run_config": peer.remote_run_config,
                "capabilities": sorted(peer.capabilities),
                "extension": peer.remote_extension.to_wire(),
                "local_extension": ext.to_wire(),
                "local_identity_sources": settings.identity_sources(),
                "extension_differences": [reason_dict(r) for r in notes],
                "data_path": peer.data_path, "data_path_detail": peer.data_path_detail}
        if args.json:
            print(json.dumps(info, sort_keys=True))
        else:
            print(f"COMPATIBLE with {args.address} ({peer.remote_node_id})")
            print(f"fingerprint:  {peer.remote_fingerprint}")
            print(f"run config:   {json.dumps(peer.remote_run_config, sort_keys=True)}")
            print(f"extension:    {peer.remote_extension.describe()}")
            print(f"local:        {ext.describe()}")
            print_sources(settings.identity_sources())
            print(f"capabilities: {', '.join(sorted(peer.capabilities)) or '(none)'}")
            path = {"shm": "shared memory", "tcp-data": "TCP data stream",
                    "nixl": "one-sided NIXL reads"}.get(
                peer.data_path, "TCP (ZeroMQ)")
            print(f"data path:    {path} ({peer.data_path_detail})")
            if notes:
                print("identity extension differences (accepted):")
                print(refusal_table(notes))
        peer.close()
    return EXIT_OK


def cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch fill blocks 0..N-1 (SPEC appendix A) and check every byte against the rule."""
    settings = settings_of(args)
    count = args.fill_keys
    if not 1 <= count <= MAX_FILL_BLOCKS:
        raise ConfigError(f"--fill-keys: must be in [1, {MAX_FILL_BLOCKS}], got {count}")
    config = client_config(settings, args.address)
    layout = settings.layout()
    rc = settings.run_config(layout)
    try:
        keys = fill_keys(count, seed=settings["key_seed"], tokens_per_hash=rc.tokens_per_hash)
    except ValueError as exc:
        raise ConfigError(f"--fill-keys: {exc}") from exc
    size = layout.bytes_per_block
    from p2pkv.node import KeyOutcome, Node

    with Node(rc, layout, pool_blocks=count, config=config,
              extension=settings.extension()) as node:
        peer = handshake(node, args, rc.fingerprint)
        if isinstance(peer, int):
            return peer
        try:
            result = peer.fetch(keys, timeout=settings["fetch_timeout"])
        except (P2PKVError, OSError) as exc:
            # The connection was lost or the fetch as a whole timed out.
            unreachable(args, exc)
            return EXIT_UNREACHABLE
        problems: list[dict[str, Any]] = []
        for i, (key, outcome) in enumerate(zip(keys, result.outcomes, strict=True)):
            if outcome is KeyOutcome.LANDED:
                error = first_mismatch(key, node.get(key), size)
                if error is not None:
                    problems.append({"index": i, "key": key.hex(), "problem": "corrupt",
                                     "detail": error})
            else:
                problems.append({"index": i, "key": key.hex(), "problem": outcome.value,
                                 "detail": result.errors.get(i, "")})
        peer.close()
    verified = count - len(problems)
    info = {"verdict": "verified" if not problems else "mismatch", "address": args.address,
            "blocks": count, "verified": verified, "bytes": result.nbytes,
            "seconds": result.seconds, "gbps": result.gbps, "problems": problems}
    if args.json:
        print(json.dumps(info, sort_keys=True))
    else:
        word = "VERIFIED" if not problems else "MISMATCH"
        print(f"{word} {verified}/{count} blocks from {args.address}: {result.nbytes} bytes "
              f"in {result.seconds:.3f} s, {result.gbps:.3f} GB/s")
        for p in problems[:20]:
            print(f"  block {p['index']} ({p['key']}): {p['problem']} {p['detail']}".rstrip())
        if len(problems) > 20:
            print(f"  ... and {len(problems) - 20} more")
    return EXIT_OK if not problems else EXIT_MISMATCH


