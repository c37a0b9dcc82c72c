"""``python -m p2pkv.bench.serving``: see :mod:`p2pkv.bench.serving`."""

from __future__ import annotations

import sys

from p2pkv.bench.serving.run import main

if __name__ == "__main__":
    sys.exit(main())
