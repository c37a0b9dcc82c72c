"""``p2pkv-node``: run, inspect and debug p2pkv nodes.

Subcommands: ``serve``, ``fingerprint``, ``probe``, ``demo``, ``keygen``, ``bench``.
Exit codes: 0 success; 2 bad configuration (nothing started); 3 peer refused the
handshake; 4 peer unreachable or timed out; 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pkv.errors import ConfigError, P2PKVError, PeerIncompatible, PeerTimeout
from p2pkv.identity import ABSENT
from p2pkv.settings import OPTIONS, Settings, load_settings

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4

log = logging.getLogger("p2pkv.cli")


def _add_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("node configuration (flag > P2PKV_* env > --config TOML)")
    group.add_argument("--config", metavar="FILE", help="TOML file with option values")
    for opt in OPTIONS:
        if opt.name == "peer":
            group.add_argument(opt.flag, dest=opt.name, action="append", metavar="ADDRESS",
                               help=opt.help)
        elif opt.parse.__name__ == "_bool":
            group.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction,
                               default=None, help=opt.help)
        else:
            group.add_argument(opt.flag, dest=opt.name, metavar=opt.name.upper(), help=opt.help)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pkv-node", description=(
        "Peer-to-peer KV-cache sharing node: fingerprinted handshakes, zero-copy blocks."))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fingerprint", help="print the run config, fingerprint and namespace")
    _add_options(p)
    p.add_argument("--root", default="/kvcache", help="storage root for the namespace")
    p = sub.add_parser("serve", help="serve blocks until SIGINT/SIGTERM")
    _add_options(p)
    p = sub.add_parser("probe", help="handshake with a node and explain the verdict")
    _add_options(p)
    p.add_argument("address", help="tcp://HOST:PORT of the node to probe")
    p = sub.add_parser("demo", help="producer, compatible and incompatible consumers, live")
    p.add_argument("--blocks", type=int, default=256, help="blocks to move (default 256)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("keygen", help="write a CURVE key pair (NAME.key, NAME.key_secret)")
    p.add_argument("directory", help="where to write the keys")
    p.add_argument("--name", default="node", help="file name stem (default: node)")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    flags = {o.name: getattr(args, o.name, None) for o in OPTIONS}
    return load_settings(flags, config_file=args.config)


def _identity(settings: Settings, root: str = "/kvcache") -> dict[str, Any]:
    layout = settings.layout()
    rc = settings.run_config(layout)
    return {
        "run_config": rc.get_run_config(),
        "fingerprint": rc.fingerprint,
        "namespace": rc.namespace(root),
        "rank": rc.rank,
        "layout": layout.name,
        "bytes_per_block": layout.bytes_per_block,
        "segments": list(layout.segment_sizes),
        "geometry": layout.geometry.summary(),
    }


def cmd_fingerprint(args: argparse.Namespace) -> int:
    ident = _identity(_settings(args), args.root)
    if args.json:
        print(json.dumps(ident, sort_keys=True))
        return EXIT_OK
    print("run config:  " + json.dumps(ident["run_config"], sort_keys=True))
    print(f"fingerprint: {ident['fingerprint']}")
    print(f"namespace:   {ident['namespace']}")
    print(f"layout:      {ident['layout']} ({len(ident['segments'])} segment(s), "
          f"{ident['bytes_per_block']} bytes/block)")
    print(f"geometry:    {ident['geometry']}")
    return EXIT_OK


def node_config(settings: Settings, *, listen: str | None = None) -> Any:
    from p2pkv.node import NodeConfig
    from p2pkv.transport import CurveKeys, load_authorized_keys

    v = settings.values
    curve = None
    if v["curve_secret_key"] is not None:
        import zmq.auth

        try:
            public, secret = zmq.auth.load_certificate(v["curve_secret_key"])
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--curve-secret-key: cannot read {v['curve_secret_key']!r}: "
                              f"{exc}") from exc
        if secret is None:
            raise ConfigError(f"--curve-secret-key: {v['curve_secret_key']!r} holds no secret "
                              "key (use the .key_secret file)")
        server_key = None
        if v["curve_server_key"] is not None:
            try:
                server_key, _ = zmq.auth.load_certificate(v["curve_server_key"])
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--curve-server-key: cannot read {v['curve_server_key']!r}: "
                                  f"{exc}") from exc
        authorized = None
        if v["curve_authorized"] is not None:
            try:
                authorized = load_authorized_keys(v["curve_authorized"])
            except ConfigError as exc:
                raise ConfigError(f"--curve-authorized: {exc}") from exc
        curve = CurveKeys(public, secret, server_key, authorized)
    try:
        return NodeConfig(
            listen=listen or v["listen"], key_hash_seed=v["key_seed"], checksums=v["checksums"],
            handshake_timeout=v["handshake_timeout"], lookup_timeout=v["lookup_timeout"],
            fetch_timeout=v["fetch_timeout"], heartbeat_timeout=v["heartbeat_timeout"],
            heartbeat_interval=min(0.5, v["heartbeat_timeout"] / 4), curve=curve,
        )
    except ConfigError as exc:
        if str(exc).startswith("listen"):
            raise ConfigError(f"--listen: {exc}") from exc
        raise


def cmd_serve(args: argparse.Namespace) -> int:
    from p2pkv.node import Node

    settings = _settings(args)
    layout = settings.layout()
    rc = settings.run_config(layout)
    config = node_config(settings)
    metrics = None
    node = Node(rc, layout, pool_blocks=settings["pool_blocks"], config=config)
    try:
        if settings["metrics_port"] is not None:
            from p2pkv.metrics import serve_metrics

            metrics = serve_metrics(node, settings["metrics_port"])
        info = {
            "event": "listening", "address": node.address, "fingerprint": rc.fingerprint,
            "namespace": rc.namespace("/kvcache"), "run_config": rc.get_run_config(),
            "layout": layout.name, "pool": node.store.stats().memory_kind,
            "metrics_port": metrics.port if metrics else None,
        }
        _emit(args, info, f"p2pkv-node listening on {node.address}\n"
              f"  fingerprint {rc.fingerprint}  namespace {info['namespace']}\n"
              f"  run config  {json.dumps(rc.get_run_config(), sort_keys=True)}\n"
              f"  layout {layout.name}, {layout.bytes_per_block} bytes/block, "
              f"pool {settings['pool_blocks']} blocks ({info['pool']})")
        for address in settings["peer"]:
            try:
                peer = node.connect(address)
                _emit(args, {"event": "peer", "address": address, "ok": True,
                             "remote": peer.remote_node_id},
                      f"connected to peer {address} ({peer.remote_node_id})")
            except P2PKVError as exc:
                _emit(args, {"event": "peer", "address": address, "ok": False,
                             "error": str(exc)}, f"peer {address}: {exc}")
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            pass
        _emit(args, {"event": "stopping"}, "shutting down")
    finally:
        if metrics is not None:
            metrics.close()
        node.close()
    _emit(args, {"event": "stopped"}, "stopped")
    return EXIT_OK


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    print(json.dumps(obj, sort_keys=True) if args.json else text, flush=True)


def _show(value: Any) -> str:
    if value is ABSENT or (isinstance(value, dict) and value == {"absent": True}):
        return "(absent)"
    return json.dumps(value, sort_keys=True, default=str)


def refusal_table(reasons: Sequence[Any]) -> str:
    """A fixed-width table of refusal reasons: field, ours, theirs, meaning."""
    rows = [("FIELD", "LOCAL", "REMOTE", "MEANING")]
    for r in reasons:
        rows.append((r.field, _show(r.ours), _show(r.theirs), r.meaning))
    widths = [min(40, max(len(row[i]) for row in rows)) for i in range(3)]
    lines = []
    for row in rows:
        cells = [row[i][: widths[i]].ljust(widths[i]) for i in range(3)]
        lines.append("  ".join([*cells, row[3]]))
    return "\n".join(lines)


def cmd_probe(args: argparse.Namespace) -> int:
    from p2pkv.node import Node
    from p2pkv.transport import validate_address

    settings = _settings(args)
    try:
        validate_address(args.address, what="ADDRESS")
    except ConfigError as exc:
        raise ConfigError(f"ADDRESS: {exc}") from exc
    layout = settings.layout()
    rc = settings.run_config(layout)
    config = node_config(settings)
    with Node(rc, layout, pool_blocks=1, config=config) as node:
        try:
            peer = node.connect(args.address)
        except PeerIncompatible as exc:
            reasons = [_reason_dict(r) for r in exc.reasons]
            if args.json:
                print(json.dumps({"verdict": "refused", "address": args.address,
                                  "local_fingerprint": rc.fingerprint,
                                  "remote": _remote_identity(exc), "reasons": reasons},
                                 sort_keys=True, default=str))
            else:
                print(f"REFUSED by handshake with {args.address}")
                remote = _remote_identity(exc)
                if remote:
                    print(f"remote node:        {remote.get('node')}")
                    print(f"remote fingerprint: {remote.get('fp')}")
                print(f"local fingerprint:  {rc.fingerprint}")
                print(refusal_table(exc.reasons))
            return EXIT_REFUSED
        except (PeerTimeout, P2PKVError) as exc:
            if args.json:
                print(json.dumps({"verdict": "unreachable", "address": args.address,
                                  "error": str(exc)}, sort_keys=True))
            else:
                print(f"UNREACHABLE {args.address}: {exc}")
            return EXIT_UNREACHABLE
        info = {"verdict": "compatible", "address": args.address,
                "remote_node": peer.remote_node_id, "fingerprint": peer.remote_fingerprint,
                "run_config": peer.remote_run_config,
                "capabilities": sorted(peer.capabilities)}
        if args.json:
            print(json.dumps(info, sort_keys=True))
        else:
            print(f"COMPATIBLE with {args.address} ({peer.remote_node_id})")
            print(f"fingerprint:  {peer.remote_fingerprint}")
            print(f"run config:   {json.dumps(peer.remote_run_config, sort_keys=True)}")
            print(f"capabilities: {', '.join(sorted(peer.capabilities)) or '(none)'}")
        peer.close()
    return EXIT_OK


def _reason_dict(reason: Any) -> dict[str, Any]:
    return {"code": int(reason.code), "field": reason.field,
            "local": None if reason.ours is ABSENT else reason.ours,
            "local_absent": reason.ours is ABSENT,
            "remote": None if reason.theirs is ABSENT else reason.theirs,
            "remote_absent": reason.theirs is ABSENT, "meaning": reason.meaning}


def _remote_identity(exc: PeerIncompatible) -> dict[str, Any]:
    remote = getattr(exc, "remote", None)
    return dict(remote) if isinstance(remote, dict) else {}


def cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    directory = Path(args.directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), args.name)
    Path(secret).chmod(0o600)
    print(f"public key: {public}\nsecret key: {secret}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from p2pkv.demo import run_demo

    return run_demo(blocks=args.blocks, as_json=args.json)


_COMMANDS = {
    "fingerprint": cmd_fingerprint,
    "serve": cmd_serve,
    "probe": cmd_probe,
    "demo": cmd_demo,
    "keygen": cmd_keygen,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", None) or "warning"
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"p2pkv-node: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
