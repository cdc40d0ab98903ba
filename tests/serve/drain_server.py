"""Run as a script: serve the tiny demo pipeline with ditq's draining uvicorn server on a free port.

Prints the port on its first line of stdout, then serves until SIGTERM. Arguments: the drain timeout in
seconds (default 30) and the number of seconds every denoising step sleeps (default 0).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the builders serve_testkit uses
from serve_testkit import make_app, sleep_per_step, tiny_adapter

from ditq.serve.connections import ConnectionLimits, uvicorn_config
from ditq.serve.server import DrainingServer


def main() -> None:
    drain_timeout_s = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    step_sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    if step_sleep_s:
        tiny_adapter().pipeline.transformer.register_forward_hook(sleep_per_step(step_sleep_s))
    app = make_app()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    config = uvicorn_config(app, ConnectionLimits(), log_level="warning")
    server = DrainingServer(config, app.state.serve, drain_timeout_s)
    server.run(sockets=[listener])


if __name__ == "__main__":
    sys.exit(main())
