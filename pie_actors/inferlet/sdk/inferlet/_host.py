"""The guest side of the host boundary: every SDK module talks to the host through here.

How it works (see also wit/inferlet.wit and pie_actors/inferlet/host.py):

- ``call(op, args)`` runs host operation ``op`` synchronously. ``args`` and the result are
  JSON values; they cross the boundary as JSON text. Use it for anything the host answers
  at once: tokenizer and model queries, chat templates, creating handles, submitting work.
  A failure on the host raises ``HostError`` here.

- Work that takes time (a forward pass, a message from the client) is a *host future*:
  the host operation returns an integer future id right away, and the host later completes
  that id with a value or an error. ``future(fid)`` gives the guest an ``asyncio.Future``
  for the id; ``call_async(op, args)`` is ``future(call(op, args))`` for operations whose
  result is a single future id. An operation may also return several ids inside a larger
  result (one per epilogue output, say); wrap each with ``future``. To hand out an
  awaitable before the id is known (``fwd.epilogue(...)`` before ``pipe.submit(fwd)``),
  create a plain future with ``new_future()`` and attach it to the id later with
  ``future(fid, fut)``. ``on_complete(fid, fn)`` calls ``fn(value, error)`` instead, in the
  loop turn that learns of it: futures ``fn`` resolves wake their tasks in that same turn.

- The guest event loop (``inferlet._loop``) resolves those futures: when it has ready
  work it calls ``poll()``; when every task waits it calls ``wait(timeout)``, which blocks
  inside the host (``wait-any``) until a future is done, so an idle inferlet costs no CPU.
  Each completed id is reported once and then forgotten on both sides.

Nothing here may call the host while the component is being built (componentize-py runs the
imports at build time to snapshot them, with no host attached): ``_live`` is False then, and
``call`` raises a RuntimeError instead of trapping the build.
"""
from __future__ import annotations

import asyncio
import json
from typing import Callable

from componentize_py_types import Err
from wit_world.imports import host as _wit

__all__ = ["HostError", "call", "call_async", "future", "new_future", "poll", "wait", "pending"]

NO_TIMEOUT_MS = 0xFFFFFFFF

# True only inside a run (set by the runner entry module); False while the build snapshots imports.
_live = False

# future id -> guest asyncio future still waiting for its completion, or the function to call with it
_pending: dict[int, asyncio.Future | Callable[[object, HostError | None], None]] = {}

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_loads = json.loads


class HostError(Exception):
    """A host operation or a host future failed; the message is the host's."""


def _check_live(op: str) -> None:
    if not _live:
        raise RuntimeError(
            f"host operation {op!r} called while the component is being built; inferlet host "
            "calls are only available while an inferlet runs")


def call(op: str, args=None):
    """Run host operation `op` with JSON-able `args`; returns its JSON result."""
    _check_live(op)
    try:
        out = _wit.call(op, _dumps(args))
    except Err as e:
        raise HostError(f"{op}: {e.value}") from None
    return _loads(out)


def new_future() -> asyncio.Future:
    """A future on the inferlet's event loop, not yet tied to a host future id."""
    return asyncio.get_event_loop().create_future()


def future(fid: int, fut: asyncio.Future | None = None) -> asyncio.Future:
    """The guest future that completes when the host completes future `fid`.

    Pass `fut` to attach an existing future (from `new_future`) to the id.
    """
    fid = int(fid)
    if fut is None:
        fut = new_future()
    if fid in _pending:
        raise ValueError(f"host future {fid} is already awaited by another guest future")
    _pending[fid] = fut
    return fut


def on_complete(fid: int, fn: Callable[[object, HostError | None], None]) -> None:
    """Call `fn(value, error)` (error: a HostError, or None) when the host completes future `fid`.
    Resolving a future from another future's callback wakes its task a loop turn later (a host call
    more); `fn` runs in the turn that learns of the completion."""
    fid = int(fid)
    if fid in _pending:
        raise ValueError(f"host future {fid} is already awaited")
    _pending[fid] = fn


def call_async(op: str, args=None) -> asyncio.Future:
    """Run an asynchronous host operation (one that returns a future id); await the result."""
    return future(call(op, args))


def pending() -> int:
    """How many host futures the guest is still waiting for."""
    return len(_pending)


def _ids() -> str:
    # drop futures the guest no longer wants (cancelled tasks) before asking the host
    for fid in [fid for fid, fut in _pending.items() if isinstance(fut, asyncio.Future) and fut.done()]:
        del _pending[fid]
    return _dumps(list(_pending))


def _resolve(completions: str) -> int:
    if completions == "{}":
        return 0
    n = 0
    for key, res in _loads(completions).items():
        fut = _pending.pop(int(key), None)
        if fut is None or (isinstance(fut, asyncio.Future) and fut.done()):
            continue
        value = res.get("ok")
        error = None if "ok" in res else HostError(res.get("err", "host future failed"))
        if not isinstance(fut, asyncio.Future):
            fut(value, error)
        elif error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)
        n += 1
    return n


def poll() -> int:
    """Resolve the futures the host has completed, without blocking; returns how many."""
    if not _pending:
        return 0
    _check_live("poll")
    return _resolve(_wit.poll(_ids()))


def wait(timeout: float | None) -> int:
    """Block in the host until a pending future completes or `timeout` seconds pass (None:
    no timeout). With nothing pending this is a plain sleep. Returns how many resolved."""
    _check_live("wait-any")
    if timeout is None:
        ms = NO_TIMEOUT_MS
    else:
        ms = min(max(0, int(timeout * 1000 + 0.999)), NO_TIMEOUT_MS - 1)
    return _resolve(_wit.wait_any(_ids(), ms))


def _reset() -> None:
    """Forget all guest futures (start of a run)."""
    _pending.clear()
