"""The WebSocket protocol of `pie serve` (`ws://HOST:PORT/v1/ws`): programs launched by clients that
come and go (`pie-client`, `pie_actors.client.Client`). Shared by the server (serve/ws.py) and the
client; nothing here imports torch.

Authentication: the HTTP API keys. Present one at the handshake (`Authorization: Bearer KEY`,
`x-api-key` or `?key=KEY`) or in a first frame `{"type": "auth", "key": KEY}`. A process belongs
to the key that launched it: under another key it does not exist ("not_found"), for every request
below and for `session.send_to` from that key's inferlets. A server without keys is single-user.

Frames: a text frame is one JSON object, a binary frame one msgpack map; the server writes each
frame in the encoding of the client's latest frame (JSON until it has sent one). Binary values
(`files`, `data`) are msgpack bin, or base64 text in JSON.

Requests (client -> server). Each may carry an "id" (any scalar), repeated in its reply:

    {"type": "auth", "key": K}                                 -> {"type": "ok"}
    {"type": "upload", "program": P}                           -> {"type": "uploaded", "hash": H}
    {"type": "launch", "hash": H, "input": {...}, "files": {NAME: DATA}, "name": N, "timeout": S,
     "detach": false}                                          -> {"type": "launched", "process": ID, "name": N}
    {"type": "attach", "process": ID}                          -> {"type": "attached", "process": ID, "name": N}
    {"type": "detach", "process": ID}                          -> {"type": "detached", "process": ID}
    {"type": "send", "process": ID, "message": M}              -> {"type": "ok"}   (its session.receive())
    {"type": "send_file", "process": ID, "data": DATA}         -> {"type": "ok"}   (its session.receive_file())
    {"type": "kill", "process": ID}                            -> {"type": "ok"}
    {"type": "ps"}                                             -> {"type": "processes", "processes": [
                                                                   {"process", "name", "state", "attached",
                                                                    "buffered", "age_s"}, ...]}
    {"type": "wait", "process": ID}                            -> its "done" or "failed" frame, once it ends
    {"type": "saved"}                                          -> {"type": "saved", "saved": [{"name", "state",
                                                                   "tokens"}, ...]}   (the key's ws.save sets)
    {"type": "delete_saved", "name": N}                        -> {"type": "ok"}   (its pages return)

P is {"source": TEXT} (a .py file; a .js file's adds "language": "javascript") or {"bundle":
{RELATIVE PATH: TEXT}} (a folder's .py files, main.py among them; a JavaScript bundle's .js files
add "language": "javascript" and "entry": the path of the module that runs); H is `program_hash(P)`: the
server keeps a key's recent uploads by hash, so a client launches a program it sent before without
sending it again ("not_found": upload it). Only "input" and "hash" are needed in a launch: "files"
are what `session.file(NAME)` reads, "name" the name the key's other inferlets `session.send_to`,
"timeout" the run's wall-clock limit in seconds (default: the server's limits.timeout_s). The
process ID is made by the server and cannot be guessed.

Events (server -> client) of the processes a connection is attached to (a launch attaches its
connection unless "detach" is true). "seq" numbers a process's events from 0, across attachments:

    {"type": "text", "process": ID, "seq": n, "text": T}       session.send (a JSON value as its JSON text)
    {"type": "file", "process": ID, "seq": n, "data": DATA}    session.send_file
    {"type": "done", "process": ID, "seq": n, "output": O}     main's result: the last event
    {"type": "failed", "process": ID, "seq": n, "kind": K, "message": M, "traceback": TB}   or how it failed
    {"type": "detached", "process": ID, "reason": R}           another connection attached it

A process has at most one attached connection; attaching takes it over. No event is sent twice or
skipped: after a "detached" frame, the process's next events wait for the next attach, which sends
them first, in order. A connection that closes detaches its processes (what was on its way to a
connection that broke is lost with it: "seq" shows the gap). While no client is
attached, a process may send up to serve.detached_buffer messages; the next one makes the server end
it (it stops at its next host call, as with kill), and the next attach reads everything it sent,
then a "failed" (kind "cancelled") that says so. A process with no client attached for
serve.idle_timeout_s is ended (its KV pages return) and forgotten. A process whose end was sent to
an attached client, or answered a "wait", is forgotten too.

Errors: {"type": "error", "id": R, "code": C, "message": M}, C one of "bad_frame" (not JSON or
msgpack, not an object, an unknown type, a missing or mistyped field), "missing_key",
"invalid_key", "not_found", "unavailable" (the engine is loading), "invalid_request" (refused: a
name in use, a message for a process that has ended, a second key), "rate_limited" (over one of
the key's quotas, serve/quotas.py), "server_error" (a fault of the server). The connection, and
every process, goes on after an error, except "invalid_key": the server closes the connection
after it (code 1008).
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import PurePosixPath
from typing import Any

import msgpack

from .process import Done, Event, Failed, File, Send
from .program import Program

__all__ = ["PATH", "CODES", "RequestError", "encode", "decode", "binary", "program_payload", "program_of",
           "program_hash", "event_frame", "frame_event"]

PATH = "/v1/ws"
CODES = ("bad_frame", "missing_key", "invalid_key", "not_found", "unavailable", "invalid_request", "rate_limited",
         "server_error")


class RequestError(Exception):
    """A request the server refused: `code` is one of CODES. The server raises it to answer with an
    error frame; the client raises it when one comes back."""

    def __init__(self, code: str, message: str) -> None:
        assert code in CODES, code
        super().__init__(message)
        self.code, self.message = code, message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# ---- frames --------------------------------------------------------------------------------------

def _base64(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON")


def encode(frame: dict[str, Any], binary: bool) -> str | bytes:
    """`frame` as a msgpack (binary) or JSON (text) frame."""
    return msgpack.packb(frame, use_bin_type=True) if binary else json.dumps(frame, default=_base64,
                                                                             ensure_ascii=False)


def decode(data: str | bytes) -> dict[str, Any]:
    """A frame's object: text is JSON, bytes are msgpack. RequestError("bad_frame") otherwise."""
    try:
        frame = json.loads(data) if isinstance(data, str) else msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        kind = "JSON" if isinstance(data, str) else "msgpack"
        raise RequestError("bad_frame", f"the frame is not valid {kind}: {e}") from None
    if not isinstance(frame, dict):
        raise RequestError("bad_frame", f"a frame is an object, not {type(frame).__name__}")
    return frame


def binary(value: Any, what: str) -> bytes:
    """A binary field's bytes: msgpack bin, or base64 text from a JSON frame."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            raise RequestError("bad_frame", f"{what}: invalid base64 data") from None
    raise RequestError("bad_frame", f"{what} must be binary data (msgpack bin, or base64 text in JSON)")


# ---- programs ------------------------------------------------------------------------------------

def program_payload(program: Program) -> dict[str, Any]:
    """What an upload carries of `program`."""
    language = {"language": program.language} if program.language != "python" else {}
    if program.bundle is not None:
        return {"bundle": program.bundle, **language, **({"entry": program.entry} if program.entry else {})}
    return {"source": program.source, **language}


def program_of(payload: Any) -> Program:
    """The Program an upload carries; RequestError("bad_frame") for anything else."""
    if (isinstance(payload, dict) and set(payload) - {"language"} == {"source"} and isinstance(payload["source"], str)
            and payload.get("language", "python") in ("python", "javascript")):
        return Program(source=payload["source"], language=payload.get("language", "python"))
    if (isinstance(payload, dict) and "bundle" in payload and set(payload) <= {"bundle", "language", "entry"}
            and isinstance(payload["bundle"], dict)):
        return _bundle_of(payload["bundle"], payload.get("language", "python"), payload.get("entry"))
    raise RequestError("bad_frame", 'program must be {"source": TEXT, "language"?: "python" | "javascript"} '
                                    'or {"bundle": {PATH: TEXT}, "language"?: ..., "entry"?: PATH (JavaScript)}')


def _bundle_of(files: dict, language: Any, entry: Any) -> Program:
    """A bundle's files, checked: relative paths of its language's modules (.py: main.py runs;
    .js: `entry` runs)."""
    suffix = {"python": ".py", "javascript": ".js"}.get(language) if isinstance(language, str) else None
    if suffix is None:
        raise RequestError("bad_frame", f'bundle language {language!r}: "python" or "javascript"')
    for path, text in files.items():
        parts = PurePosixPath(path).parts if isinstance(path, str) else ()
        if not (parts and path.endswith(suffix) and isinstance(text, str)) or path.startswith("/") or ".." in parts:
            raise RequestError("bad_frame", f"bundle file {path!r}: a {language} bundle maps relative {suffix} "
                                            "paths to text")
    if language == "python":
        if entry is not None:
            raise RequestError("bad_frame", "a Python bundle runs its main.py: it takes no entry")
        if "main.py" not in files:
            raise RequestError("bad_frame", "a bundle needs a main.py")
        return Program(bundle=dict(files))
    if entry not in files:
        raise RequestError("bad_frame", f"a JavaScript bundle's entry must be one of its files, got {entry!r}")
    return Program(bundle=dict(files), language="javascript", entry=entry)


def program_hash(program: Program) -> str:
    """The content hash a program is uploaded and launched by."""
    text = json.dumps(program_payload(program), sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# ---- events --------------------------------------------------------------------------------------

def event_frame(process: str, seq: int, event: Event) -> dict[str, Any]:
    """The frame of a process's event."""
    head = {"process": process, "seq": seq}
    if isinstance(event, Send):
        return {"type": "text", **head, "text": event.text}
    if isinstance(event, File):
        return {"type": "file", **head, "data": event.data}
    if isinstance(event, Done):
        return {"type": "done", **head, "output": event.output}
    return {"type": "failed", **head, "kind": event.kind, "message": event.message, "traceback": event.traceback}


def frame_event(frame: dict[str, Any]) -> Event:
    """The event an event frame ("text", "file", "done", "failed") carries."""
    kind = frame["type"]
    if kind == "text":
        return Send(frame["text"])
    if kind == "file":
        return File(binary(frame["data"], "data"))
    if kind == "done":
        return Done(frame.get("output"))
    return Failed(frame["kind"], frame["message"], frame.get("traceback", ""))
