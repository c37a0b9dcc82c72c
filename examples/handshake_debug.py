"""Debug a refused handshake: start a node with ``p2pkv-node serve``, probe it twice.

The first probe uses the node's own configuration and is compatible (exit 0). The second
differs in layout and dtype and is refused (exit 3) with a table naming each field,
both values and what the difference means. This is what an operator runs against a live
node whose peers keep being refused.

Run: python examples/handshake_debug.py
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys


def main() -> None:
    from p2pkv.cli import main as p2pkv_node

    serve = subprocess.Popen(
        [sys.executable, "-m", "p2pkv.cli", "serve", "--json", "--model", "demo/model",
         "--layout", "v2", "--pool-blocks", "4", "--listen", "tcp://127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        assert line, f"serve did not start: {serve.stderr.read() if serve.stderr else ''}"
        address = json.loads(line)["address"]
        print(f"node listening on {address}\n")

        print("$ p2pkv-node probe ADDRESS --model demo/model --layout v2")
        ok = p2pkv_node(["probe", address, "--model", "demo/model", "--layout", "v2"])
        assert ok == 0, ok

        print("\n$ p2pkv-node probe ADDRESS --model demo/model --layout v1 --dtype bfloat16")
        refused = p2pkv_node(["probe", address, "--model", "demo/model", "--layout", "v1",
                              "--dtype", "bfloat16"])
        assert refused == 3, refused
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            code = serve.wait(15)
        except subprocess.TimeoutExpired:
            serve.kill()
            raise
    assert code == 0, f"serve exited {code}"
    print("\nnode shut down cleanly")


if __name__ == "__main__":
    main()
