"""``p2pkv-node``: run, inspect and debug p2pkv nodes.

Subcommands: ``serve``, ``fingerprint``, ``probe``, ``fetch``, ``demo``, ``keygen``,
``bench``, ``cluster``, ``cluster-bench``, ``chaos``. Exit codes: 0 success; 2 bad configuration
(nothing started); 3 peer refused the handshake; 4 peer unreachable, lost or timed out;
5 ``fetch``: a block was missing, failed or did not match the fill rule; 6 ZeroMQ's
security handshake failed (CurveZMQ required or not offered, key not accepted, no
answer); 1 anything else.
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

from p2pkv.errors import (
    ConfigError,
    P2PKVError,
    PeerIncompatible,
    PeerTimeout,
    TransportHandshakeFailed,
)
from p2pkv.fill import MAX_FILL_BLOCKS, fill_block, fill_keys, first_mismatch
from p2pkv.identity import canonical_model_overrides, extension_diff
from p2pkv.reports import reason_dict, refusal_table, remote_identity
from p2pkv.reports import show as _show  # noqa: F401  (its old name here, for scripts)
from p2pkv.settings import OPTIONS, Settings, load_settings, node_config

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4
EXIT_MISMATCH = 5
EXIT_TRANSPORT = 6

log = logging.getLogger("p2pkv.cli")


def _add_options(parser: argparse.ArgumentParser, *, serving: bool = False) -> None:
    group = parser.add_argument_group("node configuration (flag > P2PKV_* env > --config TOML)")
    group.add_argument("--config", metavar="FILE", help="TOML file with option values")
    for opt in OPTIONS:
        if opt.name == "fill" and not serving:
            continue  # only a serving node holds content
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
    _add_options(p, serving=True)
    p = sub.add_parser("probe", help="handshake with a node and explain the verdict")
    _add_options(p)
    p.add_argument("address", help="tcp://HOST:PORT of the node to probe")
    p = sub.add_parser("fetch", help="fetch the blocks of a node started with serve --fill "
                       "and verify every byte")
    _add_options(p)
    p.add_argument("address", help="tcp://HOST:PORT of the node to fetch from")
    p.add_argument("--fill-keys", type=int, required=True, metavar="N",
                   help="fetch fill blocks 0..N-1 (protocol/SPEC.md appendix A)")
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
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw each bulk row against its baselines (needs matplotlib)")
    p = sub.add_parser("cluster", help="nodes in a Redis directory, grouped by identity")
    _add_options(p)
    p = sub.add_parser("cluster-bench", help="cluster directory scale benchmark (own Redis)")
    p.add_argument("--quick", action="store_true", help="small version, under a minute")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write results here")
    p = sub.add_parser("chaos", help="bounded fault-injection run with figures (own Redis)")
    p.add_argument("--seconds", type=float, default=600.0, help="length of the fault phase")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write results here")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    flags = {o.name: getattr(args, o.name, None) for o in OPTIONS}
    return load_settings(flags, config_file=args.config)


def _identity(settings: Settings, root: str = "/kvcache") -> dict[str, Any]:
    layout = settings.layout()
    rc = settings.run_config(layout)
    ext = settings.extension()
    overrides = settings["model_overrides"]
    return {
        "extension": ext.to_wire(),
        "extension_digest": ext.digest,
        "identity_sources": settings.identity_sources(),
        "model_overrides_canonical": (None if overrides is None
                                      else canonical_model_overrides(overrides)),
        "identity_policy": settings["identity_policy"],
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
    ext = ident["extension"]
    print("extension:   " + (json.dumps(ext, sort_keys=True) if ext else "(nothing declared)")
          + f"  digest {ident['extension_digest']} (not part of the fingerprint)")
    if ident["model_overrides_canonical"] is not None:
        print(f"overrides:   {ident['model_overrides_canonical']}")
    _print_sources(ident["identity_sources"])
    return EXIT_OK


def _print_sources(sources: dict[str, str], indent: str = "") -> None:
    """Where each identity field came from (declared, or derived and how)."""
    if sources:
        print(f"{indent}identity from:")
        for name, source in sources.items():
            print(f"{indent}  {name}: {source}")


def cmd_serve(args: argparse.Namespace) -> int:
    # Resolve the whole configuration before importing the node (and torch): a bad
    # value exits 2 at once, with nothing started.
    settings = _settings(args)
    layout = settings.layout()
    rc = settings.run_config(layout)
    ext = settings.extension()
    config = node_config(settings)
    fill = settings["fill"]
    if fill > settings["pool_blocks"]:
        raise ConfigError(f"--fill: {fill} blocks do not fit a pool of "
                          f"{settings['pool_blocks']} blocks (raise --pool-blocks)")
    try:
        fill_keys(fill, seed=settings["key_seed"], tokens_per_hash=rc.tokens_per_hash)
    except ValueError as exc:
        raise ConfigError(f"--fill: {exc}") from exc
    from p2pkv.node import Node

    # Handlers go in before anything starts, so a signal that arrives while the node
    # starts or connects to its peers still means a clean stop (exit 0).
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    metrics = None
    cluster = None
    try:
        node = Node(rc, layout, pool_blocks=settings["pool_blocks"], config=config,
                    extension=ext)
    except BaseException as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if isinstance(exc, ConfigError) and exc.option == "listen" and not exc.named:
            raise ConfigError(str(exc), option="listen") from exc
        raise
    try:
        # Filled before the listening line: whoever reads it finds the content there.
        for key in fill_keys(fill, seed=settings["key_seed"], tokens_per_hash=rc.tokens_per_hash):
            node.put(key, fill_block(key, layout.bytes_per_block))
        collectors: list[Any] = []
        if settings["directory"] != "static":
            from p2pkv.cluster import Cluster, ClusterConfig
            from p2pkv.cluster.metrics import ClusterCollector

            cluster = Cluster(node, directory=settings["directory"], peers=settings["peer"],
                              config=ClusterConfig(ttl=settings["directory_ttl"]),
                              advertise=settings["advertise"],
                              extension="" if ext.is_empty else ext.digest)
            collectors.append(ClusterCollector(cluster))
        if settings["metrics_port"] is not None:
            from p2pkv.metrics import serve_metrics

            metrics = serve_metrics(node, settings["metrics_port"], settings["metrics_host"],
                                    collectors=collectors)
        info = {
            "event": "listening", "address": node.address, "fingerprint": rc.fingerprint,
            "namespace": rc.namespace("/kvcache"), "run_config": rc.get_run_config(),
            "layout": layout.name, "pool": node.store.stats().memory_kind,
            "metrics_port": metrics.port if metrics else None, "fill": fill,
            "extension": ext.to_wire(), "identity_policy": settings["identity_policy"],
            "identity_sources": settings.identity_sources(),
        }
        _emit(args, info, f"p2pkv-node listening on {node.address}\n"
              f"  fingerprint {rc.fingerprint}  namespace {info['namespace']}\n"
              f"  run config  {json.dumps(rc.get_run_config(), sort_keys=True)}\n"
              f"  extension   {ext.describe()}, identity policy "
              f"{settings['identity_policy']}\n"
              + "".join(f"    {name} from {source}\n"
                        for name, source in info["identity_sources"].items()) +
              f"  layout {layout.name}, {layout.bytes_per_block} bytes/block, "
              f"pool {settings['pool_blocks']} blocks ({info['pool']})"
              + (f"\n  filled with {fill} blocks of known content (SPEC appendix A)"
                 if fill else ""))
        if cluster is not None:
            registered = cluster.wait_registered(min(2.0, settings["directory_ttl"]))
            _emit(args, {"event": "directory", "url": settings["directory"],
                         "registered": registered, "partition": cluster.partition},
                  f"directory {settings['directory']}: "
                  + ("registered" if registered else "unreachable, serving on and retrying")
                  + f" (partition {cluster.partition})")
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
        # A signal means a drain (below); the stopping event says for how long at most.
        _emit(args, {"event": "stopping", "drain_seconds": settings["drain_timeout"]},
              "shutting down")
    finally:
        if metrics is not None:
            metrics.close()
        # Leave the directory first, so that lookups stop pointing here; then decline
        # new fetches and let those in flight finish (a consumer fails over at once).
        if cluster is not None:
            cluster.close()
        if stop.is_set():
            log.info("draining: new fetches declined, up to %gs for those in flight",
                     settings["drain_timeout"])
            node.drain(settings["drain_timeout"])
        else:
            node.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _emit(args, {"event": "stopped"}, "stopped")
    return EXIT_OK


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    print(json.dumps(obj, sort_keys=True) if args.json else text, flush=True)


def _client_config(settings: Settings, address: str) -> Any:
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


def _handshake(node: Any, args: argparse.Namespace, fingerprint: str,
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
            _print_sources({k: v for k, v in (sources or {}).items()
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
        _unreachable(args, exc)
        return EXIT_UNREACHABLE


def _unreachable(args: argparse.Namespace, exc: BaseException) -> None:
    if args.json:
        print(json.dumps({"verdict": "unreachable", "address": args.address,
                          "error": str(exc)}, sort_keys=True))
    else:
        print(f"UNREACHABLE {args.address}: {exc}")


def cmd_probe(args: argparse.Namespace) -> int:
    settings = _settings(args)
    config = _client_config(settings, args.address)
    layout = settings.layout()
    rc = settings.run_config(layout)
    ext = settings.extension()
    from p2pkv.node import Node
    from p2pkv.protocol import Reason

    with Node(rc, layout, pool_blocks=1, config=config, extension=ext) as node:
        peer = _handshake(node, args, rc.fingerprint, settings.identity_sources())
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
            _print_sources(settings.identity_sources())
            print(f"capabilities: {', '.join(sorted(peer.capabilities)) or '(none)'}")
            path = {"shm": "shared memory", "tcp-data": "TCP data stream"}.get(
                peer.data_path, "TCP (ZeroMQ)")
            print(f"data path:    {path} ({peer.data_path_detail})")
            if notes:
                print("identity extension differences (accepted):")
                print(refusal_table(notes))
        peer.close()
    return EXIT_OK


def cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch fill blocks 0..N-1 (SPEC appendix A) and check every byte against the rule."""
    settings = _settings(args)
    count = args.fill_keys
    if not 1 <= count <= MAX_FILL_BLOCKS:
        raise ConfigError(f"--fill-keys: must be in [1, {MAX_FILL_BLOCKS}], got {count}")
    config = _client_config(settings, args.address)
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
        peer = _handshake(node, args, rc.fingerprint)
        if isinstance(peer, int):
            return peer
        try:
            result = peer.fetch(keys, timeout=settings["fetch_timeout"])
        except (P2PKVError, OSError) as exc:
            # The connection was lost or the fetch as a whole timed out.
            _unreachable(args, exc)
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
    if args.plot is not None:
        from p2pkv.bench.plot import check_plotting

        check_plotting()  # before minutes of benchmarks, not after
    return run_bench(quick=args.quick, json_path=args.json_path, plot_path=args.plot)


def cmd_cluster(args: argparse.Namespace) -> int:
    from p2pkv.cluster import DirectoryError, RedisDirectory
    from p2pkv.cluster.view import render, report

    settings = _settings(args)
    if settings["directory"] == "static":
        raise ConfigError("--directory: the cluster command reads a Redis directory; give "
                          "--directory redis://HOST:PORT/DB")
    directory = RedisDirectory(settings["directory"])
    try:
        view = directory.view()
    except DirectoryError as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}, sort_keys=True))
        else:
            print(f"UNREACHABLE {exc}")
        return EXIT_UNREACHABLE
    finally:
        directory.close()
    if args.json:
        print(json.dumps(report(view), sort_keys=True, default=str))
    else:
        print(render(view, refusal_table))
    return EXIT_OK


def cmd_cluster_bench(args: argparse.Namespace) -> int:
    from p2pkv.bench.directory import run_cluster_bench

    return run_cluster_bench(quick=args.quick, json_path=args.json_path)


def cmd_chaos(args: argparse.Namespace) -> int:
    from p2pkv.bench.chaos import run_chaos

    return run_chaos(args.seconds, seed=args.seed, json_path=args.json_path)


_COMMANDS = {
    "fingerprint": cmd_fingerprint,
    "serve": cmd_serve,
    "probe": cmd_probe,
    "fetch": cmd_fetch,
    "demo": cmd_demo,
    "keygen": cmd_keygen,
    "bench": cmd_bench,
    "cluster": cmd_cluster,
    "cluster-bench": cmd_cluster_bench,
    "chaos": cmd_chaos,
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
