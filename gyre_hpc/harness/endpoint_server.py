"""The endpoint served on the caller's event loop: the controller's, during rollout.

Why on that loop and not in a thread: a session's model calls go through the same client the
harness's own runs use (``rl.router_client.CountingRunClient`` on the RL controller, whose
futures the step driver's pump resolves on its loop; ``EngineCalls`` in tests), so the request
handlers must await on the loop that steps the engines. The loop runs only while a step does;
between steps the server is paused, which is harmless (no run is live then).

Why a socket bound here: the port is known (and connections queue in its backlog) before
uvicorn's task first runs, so a scaffold started right after ``start`` finds it.

Why uvicorn's signal capture is off: on the controller's main thread it would replace the
fleet's own SIGTERM/SIGINT handlers for as long as the server runs.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from gyre_hpc.harness.chat_render import ChatRenderer
from gyre_hpc.harness.endpoint import create_app
from gyre_hpc.harness.endpoint_sessions import SessionRegistry


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class EndpointServer:
    """``/v1`` over ``registry``'s sessions on ``host``:<a free port>; ``url`` is the base URL
    a scaffold gets as ``OPENAI_BASE_URL``."""

    def __init__(self, renderer: ChatRenderer, *, model_name: str, context_window: int, default_max_tokens: int,
                 max_tokens_limit: int | None = None, host: str = "127.0.0.1",
                 registry: SessionRegistry | None = None) -> None:
        self.registry = registry or SessionRegistry()
        self.app = create_app(self.registry, renderer, model_name=model_name, context_window=context_window,
                              default_max_tokens=default_max_tokens, max_tokens_limit=max_tokens_limit)
        self.model_name = model_name
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}/v1"
        self._server = _QuietServer(uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False))
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Serve from now on (call on the loop that will run the handlers)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))

    async def stop(self) -> None:
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, 10)
        self._task = None
        self._sock.close()
