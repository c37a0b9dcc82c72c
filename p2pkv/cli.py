"""``p2pkv-node``: run, inspect and debug p2pkv nodes.

Subcommands: ``serve``, ``fingerprint``, ``probe``, ``fetch``, ``demo``, ``keygen``,
``bench``, ``cluster``, ``cluster-bench``, ``chaos``. Exit codes: 0 success; 2 bad
configuration (nothing started); 3 peer refused the handshake; 4 peer unreachable, lost
or timed out; 5 ``fetch``: a block was missing, failed or did not match the fill rule;
6 ZeroMQ's security handshake failed (CurveZMQ required or not offered, key not
accepted, no answer); 1 anything else.

This module is the command line: the parser, the dispatch, and the commands that start
no node of their own. ``serve``, ``probe`` and ``fetch`` are in :mod:`p2pkv.commands`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pkv.commands.common import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TRANSPORT,
    EXIT_UNREACHABLE,
    print_sources,
    settings_of,
)
from p2pkv.commands.peer import cmd_fetch, cmd_probe
from p2pkv.commands.serve import cmd_serve
from p2pkv.errors import ConfigError
from p2pkv.identity import canonical_model_overrides
from p2pkv.protocol.options import Bool
from p2pkv.reports import refusal_table
from p2pkv.reports import show as _show  # noqa: F401  (its old name here, for scripts)
from p2pkv.settings import OPTIONS, Settings, node_config

__all__ = [
    "EXIT_CONFIG",
    "EXIT_ERROR",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_TRANSPORT",
    "EXIT_UNREACHABLE",
    "build_parser",
    "cmd_fetch",
    "cmd_probe",
    "cmd_serve",
    "main",
    "node_config",
    "refusal_table",
]


def _add_options(parser: argparse.ArgumentParser, *, serving: bool = False) -> None:
    group = parser.add_argument_group("node configuration (flag > P2PKV_* env > --config TOML)")
    group.add_argument("--config", metavar="FILE", help="TOML file with option values")
    for opt in OPTIONS:
        if opt.name == "fill" and not serving:
            continue  # only a serving node holds content
        if opt.name == "peer":
            group.add_argument(opt.flag, dest=opt.name, action="append", metavar="ADDRESS",
                               help=opt.help)
        elif isinstance(opt.kind, Bool):
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
    ident = _identity(settings_of(args), args.root)
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
    print_sources(ident["identity_sources"])
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
    if args.plot is not None:
        from p2pkv.bench.plot import check_plotting

        check_plotting()  # before minutes of benchmarks, not after
    return run_bench(quick=args.quick, json_path=args.json_path, plot_path=args.plot)


def cmd_cluster(args: argparse.Namespace) -> int:
    from p2pkv.cluster import DirectoryError, RedisDirectory
    from p2pkv.cluster.view import render, report

    settings = settings_of(args)
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
        return str(settings_of(args)["log_level"])
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
