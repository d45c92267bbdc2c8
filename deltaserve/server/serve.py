"""The server process: uvicorn over the app, with a shutdown bounded in time.

On SIGINT or SIGTERM the server stops taking requests and ends each one in flight at once with a final
event (a stream: an error event, then [DONE]; a waiting request: a 503), so its connections close and
the process exits within a few seconds instead of waiting for every generation to finish. A second
signal exits without waiting for anything."""

from __future__ import annotations

import os
import signal

import uvicorn
from fastapi import FastAPI

GRACE_SECONDS = 2.0  # after which uvicorn cancels what still runs (a client that does not read its stream)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:  # uvicorn forces its exit on a second SIGINT only; SIGTERM too here
            self.force_exit = True
        else:
            self.on_exit()
        super().handle_exit(sig, frame)


def serve(app: FastAPI, host: str, port: int) -> None:
    """Serve `app` (made by create_app) until a signal; returns once the server has shut down (SIGINT as
    KeyboardInterrupt, SIGTERM as SystemExit), so the caller's cleanup runs; after a second signal the
    process exits at once."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACE_SECONDS)
    server = _Server(config, app.state.inflight.shutdown)

    def terminated(sig, frame):  # uvicorn raises the signal it caught again once it has shut down
        if server.force_exit:
            os._exit(128 + sig)
        raise SystemExit(128 + sig)  # not SIGTERM's default action, which would skip the caller's cleanup

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
