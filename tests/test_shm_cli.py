"""``p2pkv-node --shm``: serve puts its pool in shared memory, probe shows the data path."""

from __future__ import annotations

import json
import signal

import pytest
from clitools import MODEL, Serve, finish, start

pytestmark = pytest.mark.timeout(180)


def test_probe_shows_the_data_path() -> None:
    serve = Serve("--model", MODEL, "--shm", "--pool-blocks", "8", "--json")
    try:
        ready = serve.event()
        address = ready["address"]
        shm = start("probe", address, "--model", MODEL, "--shm")
        plain = start("probe", address, "--model", MODEL, "--json")
        code, out, err = finish(shm)
        assert code == 0, err
        assert "data path:    shared memory (segment p2pkv-" in out, out
        assert ", mapped read-only)" in out
        assert "shm-v1" in out
        code, out, err = finish(plain)
        assert code == 0, err
        info = json.loads(out)
        assert info["data_path"] == "tcp-data"
        assert info["data_path_detail"].startswith("data stream to 127.0.0.1:")
    finally:
        code, _ = serve.stop(signal.SIGTERM)
    assert code == 0
