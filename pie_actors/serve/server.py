"""`Server`: `pie serve` inside a Python process (what the `pie serve` command runs, too).

    with Server(model="smollm2-135m-instruct", port=0) as server:     # local=True: no Ray
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")

The app listens at once (uvicorn with uvloop, on a thread of its own) and answers 503 until the
engine has loaded, which happens on another thread: `Runtime.local` (its engine in a child process),
or `Runtime.connect` to the Ray cluster with `local=False`. Entering the context waits for the engine.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ..config import Config, load
from ..model_store import resolve_model
from .app import build_app
from .inferlets import Endpoints
from .metrics import Metrics
from .quotas import Quotas
from .routes import Serving
from .sessions import Sessions
from .stored import StoredResponses

__all__ = ["Server", "served_names", "api_keys"]

log = logging.getLogger("pie.serve")

def model_name(model: str) -> str:
    """The name the engine gives `model`: a stored model's name, or the folder a path resolves to."""
    return resolve_model(model).name if Path(model).expanduser().exists() else model


def served_names(config: Config) -> tuple[str, ...]:
    """What the model answers to: "default", its store name, and the configured names."""
    names = ["default", model_name(config.engine.model), *config.serve.served_model_names]
    return tuple(dict.fromkeys(names))


def api_keys(config: Config) -> tuple[str, ...]:
    """The configured keys and those in PIE_API_KEYS (comma-separated)."""
    extra = [k.strip() for k in os.environ.get("PIE_API_KEYS", "").split(",") if k.strip()]
    return tuple(dict.fromkeys([*config.serve.api_keys, *extra]))


class Server:
    """The OpenAI, Anthropic and Gemini APIs, and pie-client's WebSocket, on one port, for `model`
    (default: the configured one). `settings` override the config by name (host, port, api_keys,
    served_model_names, routes, idle_timeout_s, and the engine's and runs' settings: dtype,
    num_pages, timeout_s...); `port=0` picks a free port.
    `local`: no Ray: the engine in a child process of this one, started again if it dies (as
    `pie serve --local` runs it; see Runtime.local), or in this process too with
    `engine_process=False`; else the Ray cluster at `address`, RAY_ADDRESS or here."""

    def __init__(self, model: str | None = None, *, local: bool = True, address: str | None = None,
                 access_log: bool = False, engine_process: bool = True, **settings: Any) -> None:
        self.settings = {"model": model, **{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}}
        self.config = load(**self.settings)
        self.local, self.address, self.access_log = local, address, access_log
        self.engine_process = engine_process
        self.api_keys = api_keys(self.config)
        metrics = Metrics()
        serve = self.config.serve
        quotas = Quotas(serve.quotas, running=lambda owner: self.serving.runtime.running(owner))
        self._endpoints = Endpoints(serve.routes, metrics, quotas)
        self.serving = Serving(model_name(self.config.engine.model), served_names(self.config), metrics,
                               Sessions(serve.idle_timeout_s, serve.detached_buffer, spent=quotas.used),
                               responses=StoredResponses(serve.stored_responses), quotas=quotas,
                               default_max_tokens=serve.default_max_tokens)
        self._loaded = threading.Event()
        self._uvicorn = None
        self._threads: list[threading.Thread] = []
        self._started_ray = False

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> Server:
        """Listen, and load the engine in the background."""
        import uvicorn

        serve = self.config.serve
        self._socket = socket.create_server((serve.host, serve.port), reuse_port=False)
        host, port = self._socket.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        config = uvicorn.Config(build_app(self.serving, self.api_keys), loop="uvloop", lifespan="off",
                                log_level="info" if self.access_log else "warning", access_log=self.access_log)
        self._uvicorn = uvicorn.Server(config)
        if not self.api_keys:
            log.warning("pie serve: no API keys: single-user mode, open to anyone who can reach %s (set --api-key, "
                        "serve.api_keys in the config, or PIE_API_KEYS)", self.url)
        if not self.local:
            # here, not in the loader thread: a Ray cluster started for this server dies with the
            # thread that starts it (`start_ray`)
            from ..runtime import start_ray
            self._started_ray = start_ray(self.address)
        self._spawn(self._listen, "pie-serve-http")
        self._spawn(self._load, "pie-serve-load")
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._threads[0].is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for the engine to serve (its model loaded; decode buckets still to compile compile
        behind); raises RuntimeError if it could not be loaded."""
        if not self._loaded.wait(timeout):
            raise TimeoutError(f"the engine did not load within {timeout} s")
        if self.serving.loading_error is not None:
            raise RuntimeError(f"the engine could not be loaded: {self.serving.loading_error}")

    def serve_forever(self) -> None:
        """Serve until the HTTP server stops (Ctrl-C); then close."""
        try:
            self._threads[0].join()
        finally:
            self.close()

    def close(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        for thread in self._threads:
            thread.join()                          # the loader too: a runtime it is making is closed below
        runtime, self.serving.runtime, self.serving.endpoints = self.serving.runtime, None, None
        if runtime is not None:
            runtime.close()
        if self._started_ray:
            import ray
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Server:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def runtime(self):
        """The Runtime the endpoints launch on (None until the engine has loaded)."""
        return self.serving.runtime

    # ---- threads ------------------------------------------------------------------------------

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _listen(self) -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(self._uvicorn.serve(sockets=[self._socket]))
        finally:
            # what still reads a process (a WebSocket session's pump) ends with the loop, not as a
            # task destroyed while pending
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:    # gather() of nothing asks for the thread's loop, which it has not set
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    def _load(self) -> None:
        from ..runtime import Runtime

        try:
            runtime = (Runtime.local(long_lived=True, engine_process=self.engine_process, **self.settings) if self.local
                       else Runtime.connect(self.address, **self.settings))
            self._endpoints.runtime = self.serving.runtime = runtime
            self.serving.endpoints = self._endpoints
        except Exception as e:
            self.serving.loading_error = f"{type(e).__name__}: {e}"
        finally:
            self._loaded.set()
