"""`python -m services.gateway`: the Starlette app on uvicorn, with a graceful drain.

SIGTERM (or Ctrl-C) starts a drain: /ready turns 503 and new requests get 503 while in-flight requests
finish, for at most drain_timeout_s; then the server stops. A second signal stops at once. The gateway
also stops when its parent (the launcher) is gone, so no orphan keeps the port.
"""
from __future__ import annotations

import os
import signal
import time

import uvicorn

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.gateway.state import GatewayState
from shared.log import configure_logging, get_logger
from shared.ports import listen_socket


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: GatewayState, drain_timeout_s: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self.parent_pid = os.getppid()
        self.log = get_logger("gateway")

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is None and sig in (signal.SIGTERM, signal.SIGINT):
            # Runs in a signal handler: only plain assignments here, the drain proceeds in on_tick.
            self.state.draining = True
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None:
            if counter % 10 == 0:
                self.log.info("draining", in_flight=self.state.inflight)
            if self.state.inflight == 0 or time.monotonic() > self.drain_deadline:
                return True
        if counter % 10 == 0 and os.getppid() != self.parent_pid:
            self.log.warning("parent process gone; stopping")
            return True
        return await super().on_tick(counter)


def main(argv: list[str] | None = None) -> None:
    config = GatewayConfig.from_args(argv)
    configure_logging(json=config.log_json, level=config.log_level)
    listener = listen_socket(config.host, config.port, get_logger("gateway"))
    state = GatewayState(config)
    app = build_app(config, state)
    server = DrainingServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_config=None, access_log=False,
                       timeout_graceful_shutdown=5, timeout_keep_alive=config.keep_alive_s, lifespan="on"),
        state, config.drain_timeout_s)
    server.run(sockets=[listener])

