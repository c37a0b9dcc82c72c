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
from p2pkv.reports import reason_dict, refusal_table, remote_identity
from p2pkv.reports import show as _show  # noqa: F401  (its old name here, for scripts)
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
    p = sub.add_parser("bench", help="benchmarks against raw pyzmq, side by side")
    p.add_argument("--quick", action="store_true", help="small version, under a minute")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write results here")
    p.add_argument("--soak", type=float, metavar="SECONDS", help="eight-consumer soak run")
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
    from p2pkv.transport import CurveKeys, load_authorized_keys, validate_address

    v = settings.values
    try:
        validate_address(listen or v["listen"], what="listen")
    except ConfigError as exc:
        raise ConfigError(f"--listen: {exc}") from exc
    curve = None
    if v["curve_secret_key"] is None:
        # Never run in the clear while the operator believes CURVE is on.
        for name in ("curve_authorized", "curve_server_key"):
            if v[name] is not None:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag}: needs --curve-secret-key (CURVE is off without "
                                  "this node's own key pair)")
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
    # Imported last: p2pkv.node pulls in torch (seconds), and a bad --curve-* value
    # above should fail at once.
    from p2pkv.node import NodeConfig

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
    # Resolve the whole configuration before importing the node (and torch): a bad
    # value exits 2 at once, with nothing started.
    settings = _settings(args)
    layout = settings.layout()
    rc = settings.run_config(layout)
    config = node_config(settings)
    from p2pkv.node import Node

    # Handlers go in before anything starts, so a signal that arrives while the node
    # starts or connects to its peers still means a clean stop (exit 0).
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    metrics = None
    try:
        node = Node(rc, layout, pool_blocks=settings["pool_blocks"], config=config)
    except BaseException as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if isinstance(exc, ConfigError) and str(exc).startswith("cannot listen"):
            raise ConfigError(f"--listen: {exc}") from exc
        raise
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
            if stop.is_set():
                break
            try:
                peer = node.connect(address)
                _emit(args, {"event": "peer", "address": address, "ok": True,
                             "remote": peer.remote_node_id},
                      f"connected to peer {address} ({peer.remote_node_id})")
            except (P2PKVError, OSError) as exc:
                _emit(args, {"event": "peer", "address": address, "ok": False,
                             "error": str(exc)}, f"peer {address}: {exc}")
        while not stop.wait(0.5):
            pass
        _emit(args, {"event": "stopping"}, "shutting down")
    finally:
        if metrics is not None:
            metrics.close()
        node.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _emit(args, {"event": "stopped"}, "stopped")
    return EXIT_OK


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    print(json.dumps(obj, sort_keys=True) if args.json else text, flush=True)


def cmd_probe(args: argparse.Namespace) -> int:
    from p2pkv.transport import validate_address

    settings = _settings(args)
    try:
        validate_address(args.address, what="ADDRESS")
    except ConfigError as exc:
        raise ConfigError(f"ADDRESS: {exc}") from exc
    layout = settings.layout()
    rc = settings.run_config(layout)
    if settings["curve_secret_key"] is not None and settings["curve_server_key"] is None:
        raise ConfigError("--curve-server-key: probing with CURVE needs the server's public "
                          "key file")
    # The probe only connects out: it never uses the configured --listen address (a
    # shared TOML file or P2PKV_LISTEN would name the serving node's port, already taken).
    config = node_config(settings, listen="tcp://127.0.0.1:0")
    from p2pkv.node import Node

    with Node(rc, layout, pool_blocks=1, config=config) as node:
        try:
            peer = node.connect(args.address)
        except PeerIncompatible as exc:
            reasons = [reason_dict(r) for r in exc.reasons]
            if args.json:
                print(json.dumps({"verdict": "refused", "address": args.address,
                                  "local_fingerprint": rc.fingerprint,
                                  "remote": remote_identity(exc), "reasons": reasons},
                                 sort_keys=True, default=str))
            else:
                print(f"REFUSED by handshake with {args.address}")
                remote = remote_identity(exc)
                if remote:
                    print(f"remote node:        {remote.get('node')}")
                    print(f"remote fingerprint: {remote.get('fp')}")
                print(f"local fingerprint:  {rc.fingerprint}")
                print(refusal_table(exc.reasons))
            return EXIT_REFUSED
        except (PeerTimeout, P2PKVError, OSError) as exc:
            # Any failure to reach the peer (timeout, refused or lost connection,
            # unresolvable host) is "unreachable", exit 4.
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


def cmd_keygen(args: argparse.Namespace) -> int:
    import os

    import zmq.auth

    directory = Path(args.directory)
    for existing in (directory / f"{args.name}.key", directory / f"{args.name}.key_secret"):
        if existing.exists():
            # Replacing a key pair would lock this node out of every peer that trusts it.
            raise ConfigError(f"DIRECTORY: {str(existing)!r} exists; remove it or choose "
                              "another --name")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"DIRECTORY: cannot create {str(directory)!r}: {exc}") from exc
    # The secret is never readable by others, not even between its creation and a chmod.
    umask = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(str(directory), args.name)
    finally:
        os.umask(umask)
    Path(secret).chmod(0o600)
    Path(public).chmod(0o644)
    print(f"public key: {public}\nsecret key: {secret}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from p2pkv.demo import run_demo

    return run_demo(blocks=args.blocks, as_json=args.json)


def cmd_bench(args: argparse.Namespace) -> int:
    from p2pkv.bench import run_bench, run_soak

    if args.soak is not None:
        return run_soak(args.soak, json_path=args.json_path)
    return run_bench(quick=args.quick, json_path=args.json_path)


_COMMANDS = {
    "fingerprint": cmd_fingerprint,
    "serve": cmd_serve,
    "probe": cmd_probe,
    "demo": cmd_demo,
    "keygen": cmd_keygen,
    "bench": cmd_bench,
}


def _log_level(args: argparse.Namespace) -> str:
    """The resolved ``log_level`` (flag > env > TOML > default) of a command that takes
    node options; ``warning`` otherwise, or when the options are invalid (the command
    itself then reports the error and exits 2)."""
    if not hasattr(args, "log_level"):
        return "warning"
    try:
        return str(_settings(args)["log_level"])
    except ConfigError:
        return "warning"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = _log_level(args)
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
