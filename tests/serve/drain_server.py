"""Run as a script: serve the tiny demo pipeline with ditq's draining uvicorn server on a free port.

Prints the port on its first line of stdout, then serves until SIGTERM.
"""

from __future__ import annotations

import socket
import sys

import uvicorn
from serve_testkit import make_app

from ditq.serve.server import DrainingServer


def main() -> None:
    app = make_app()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    server = DrainingServer(uvicorn.Config(app, log_level="warning"), app.state.serve)
    server.run(sockets=[listener])


if __name__ == "__main__":
    sys.exit(main())
