"""``python -m p2pkv.bench ROLE SPEC_JSON``: one benchmark worker process."""

from __future__ import annotations

import sys

from p2pkv.bench.worker import main_worker

if __name__ == "__main__":
    sys.exit(main_worker(sys.argv[1:]))
