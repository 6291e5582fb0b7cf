"""`python -m gateway --port 30000 --tokenizer HOST:50051`: one uvicorn worker serving the app.

Prints ringserve.process.READY_LINE once the socket is bound and the lifespan has run, which is
what the launcher and the end-to-end tests wait for.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator

import uvicorn

from gateway.app import create_app
from gateway.config import load_config
from ringserve.logs import setup_logging
from ringserve.process import READY_LINE


class _Server(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:  # startup failed (port taken, lifespan error): no readiness line
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(f"{READY_LINE} http://{self.config.host}:{port}", flush=True)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises SIGTERM after draining (exit -15); for us SIGTERM is the normal stop,
        # so a drained shutdown exits 0 as the other services do.
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def main(argv: list[str] | None = None) -> int:
    config = load_config(argv)
    setup_logging("gateway", config.log_level)
    app = create_app(config)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, workers=1,
                                    log_level=config.log_level.lower(), access_log=False,
                                    timeout_graceful_shutdown=30, log_config=None))
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
