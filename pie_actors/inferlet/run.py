"""One inferlet run: a `Run` connects a host (ops.py) to the engine, runs the program in its sandbox
and reports what happens as events (pie_actors.process): Send and File while it runs, then Done or
Failed. The launch API's local runtime and the InferletActor both run programs through here.

Sandboxes are shared by every run of the process: one for the runner component (source text, and
the bundles whose imports it holds), and one per recent bundle that needs more of the stdlib (its
own component, built once and cached on disk by content hash).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

from ..gpu.engine.wire import EngineAddress
from ..launch import Launch
from ..process import Done, Event, Failed
from ..program import Program
from .build import cache_dir, ensure_js_runner, fits_runner, runner_modules
from .host import HostOpError, InferletError, Sandbox
from .ops import InferletHost
from .peers import Peers
from .run_state import EngineChoice

__all__ = ["Run", "sandbox_for"]

MAX_BUNDLES = 4          # bundle sandboxes kept loaded per process

# bundle key (None: the runner, JAVASCRIPT: the JavaScript runner) -> Sandbox
_sandboxes: OrderedDict[str | None, Sandbox] = OrderedDict()
JAVASCRIPT = "javascript"
_sandboxes_lock = threading.Lock()


def sandbox_for(program: Program) -> Sandbox:
    """The Sandbox that runs `program`: the shared runner (source text, or a bundle whose imports it
    holds: its files go to the guest at launch), the bundle's own component (unpacked under the
    cache and built on first use), or for a JavaScript program the JavaScript runner."""
    if program.language == JAVASCRIPT:
        key = JAVASCRIPT
    else:
        key = None if program.bundle is None or fits_runner(program.bundle) else program.bundle_key()
    with _sandboxes_lock:
        sandbox = _sandboxes.get(key)
        if sandbox is None:
            if key == JAVASCRIPT:
                sandbox = Sandbox(runner=ensure_js_runner)
            else:
                sandbox = Sandbox() if key is None else Sandbox(bundle=_unpack(program.bundle, key))
            bundles = [k for k in _sandboxes if k not in (None, JAVASCRIPT)]
            if key not in (None, JAVASCRIPT) and len(bundles) >= MAX_BUNDLES:
                del _sandboxes[bundles[0]]
            _sandboxes[key] = sandbox
        _sandboxes.move_to_end(key)
        return sandbox


def _unpack(files: dict[str, str], key: str):
    folder = cache_dir() / "bundles" / key
    for rel, text in files.items():
        path = folder / rel
        if folder.resolve() not in path.resolve().parents:
            raise ValueError(f"bundle path {rel!r} leaves the bundle")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return folder


class Run:
    """One run of `launch` against the engine at `engine_address` (or the replica an EngineChoice
    makes at its first pass); everything it streams, and how it ends, goes to `emit`. `peers`: how
    it reaches its owner's other processes (None: a run with no process name). `deliver`,
    `deliver_file` and `cancel` may be called from any thread at any time: what arrives before the
    run's host exists waits for it."""

    def __init__(self, launch: Launch, engine_address: EngineAddress | EngineChoice,
                 emit: Callable[[Event], None], peers: Peers | None = None) -> None:
        self.launch, self.engine_address, self.emit, self.peers = launch, engine_address, emit, peers
        self._lock = threading.Lock()
        self._host: InferletHost | None = None
        # what arrives before the host exists: ("message", (message, sender)) or ("file", data)
        self._early: list[tuple[str, Any]] = []
        self._cancelled: str | None = None
        self._restartable = False      # it declared so, and its engine connection was lost
        self._tokens = 0               # what it cost the engine (RunState.tokens), once it ended

    @property
    def engine(self) -> tuple[str, int] | None:
        """(host, port) of the engine the run uses (None: not chosen yet)."""
        with self._lock:
            host = self._host
        if host is not None:
            return host.state.address
        return None if isinstance(self.engine_address, EngineChoice) else tuple(self.engine_address[:2])

    def start(self) -> threading.Thread:
        """Run on a thread of its own."""
        thread = threading.Thread(target=self.run, name="inferlet", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        """Run to the end; always emits Done or Failed last."""
        try:
            output = self._run()
        except InferletError as e:
            self.emit(Failed.of(e, self._restartable, self._tokens))
        except Exception as e:           # a bundle that does not build, say
            self.emit(Failed("trap", f"{type(e).__name__}: {e}", tokens=self._tokens))
        else:
            self.emit(Done(output, self._tokens))

    def _run(self) -> Any:
        launch = self.launch
        sandbox = sandbox_for(launch.program)
        try:
            host = InferletHost(self.engine_address, launch, emit=self.emit, peers=self.peers)
        except (OSError, HostOpError, TimeoutError) as e:
            raise InferletError("trap", f"cannot reach the engine at {self.engine_address}: "
                                        f"{type(e).__name__}: {e}") from None
        with self._lock:
            self._host = host
            for kind, payload in self._early:
                host.deliver(*payload) if kind == "message" else host.deliver_file(payload)
            self._early.clear()
            if self._cancelled is not None:
                host.cancel(self._cancelled)
        try:
            modules = runner_modules(launch.program) if sandbox.is_runner else None
            return sandbox.run(launch.program.source, launch.input, host, limits=launch.limits, bundle=modules)
        finally:
            self._restartable = host.state.restartable and host.state.lost_engine
            self._tokens = host.state.tokens
            with self._lock:
                self._host = None

    def deliver(self, message: Any, sender: str | None = None) -> bool:
        """A message for the run's `session.receive`, from the client or from process `sender`;
        False when the mailbox is full (a process's message only: the client's are always taken)."""
        with self._lock:
            if self._host is not None:
                return self._host.deliver(message, sender)
            early = sum(kind == "message" and payload[1] is not None for kind, payload in self._early)
            if sender is not None and early >= self.launch.limits.mailbox_size:
                return False
            self._early.append(("message", (message, sender)))
            return True

    def deliver_file(self, data: bytes) -> None:
        """Data for the run's `session.receive_file`."""
        with self._lock:
            if self._host is None:
                self._early.append(("file", data))
            else:
                self._host.deliver_file(data)

    def cancel(self, reason: str) -> None:
        """End the run at its next host call (before it starts, if it has not yet)."""
        with self._lock:
            self._cancelled = reason
            if self._host is not None:
                self._host.cancel(reason)
