"""What the ``p2pkv-node`` commands share: the exit codes (what each means is listed in
:mod:`p2pkv.cli`), the node options of a parsed command line, and their output.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from p2pkv.settings import OPTIONS, Settings, load_settings

__all__ = [
    "EXIT_CONFIG",
    "EXIT_ERROR",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_TRANSPORT",
    "EXIT_UNREACHABLE",
    "emit",
    "print_sources",
    "settings_of",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4
EXIT_MISMATCH = 5
EXIT_TRANSPORT = 6


def settings_of(args: argparse.Namespace) -> Settings:
    """The node options of a command: its flags, then P2PKV_* variables, then the TOML
    file of ``--config``."""
    flags = {o.name: getattr(args, o.name, None) for o in OPTIONS}
    return load_settings(flags, config_file=args.config)


def emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    """One event: ``obj`` as a JSON line under ``--json``, else ``text``."""
    print(json.dumps(obj, sort_keys=True) if args.json else text, flush=True)


def print_sources(sources: dict[str, str], indent: str = "") -> None:
    """Where each identity field came from (declared, or derived and how)."""
    if sources:
        print(f"{indent}identity from:")
        for name, source in sources.items():
            print(f"{indent}  {name}: {source}")
