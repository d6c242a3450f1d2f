"""pie serve's WebSocket (/v1/ws) through raw frames, JSON and msgpack: detach and re-attach lose and
repeat nothing, a process does not exist under another key, bad frames get error frames and change
nothing, the detached buffer's limit ends a process, and an idle one is ended with its pages."""
from __future__ import annotations

import json
import time

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from pie_actors.program import Program
from pie_actors.ws_protocol import decode, encode, program_hash
from serve_helpers import KEY, idle, start

OTHER = "other-key"
LIMIT = 8               # the server's serve.detached_buffer

COUNTER = """
from inferlet import session

async def main(input):
    sent = 0
    while (count := await session.receive()) != 0:
        for _ in range(count):
            session.send({"n": sent})
            sent += 1
    return {"sent": sent}
"""

HOLDER = """
from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()          # KV pages, held while it waits
    fwd = ForwardPass()
    fwd.embed(chat.prefix() + model.encode("A long wait begins here"))
    fwd.state([ws])
    first = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    await first
    session.send("ready")
    return {"got": await session.receive()}
"""

SEND_TO = """
from inferlet import session

async def main(input):
    session.send_to(input["to"], "hello")
    return {}
"""

@pytest.fixture(scope="module")
def server(default_model_dir):
    with start(default_model_dir, api_keys=(KEY, OTHER), detached_buffer=LIMIT) as s:
        yield s


class Conn:
    """A raw WebSocket connection: frames in the given encoding; events that arrive while a request
    waits for its answer are kept in `events`."""

    def __init__(self, server, key: str | None = KEY, binary: bool = False) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        self.ws = connect(server.url.replace("http", "ws") + "/v1/ws", additional_headers=headers).__enter__()
        self.binary, self.events, self.ids = binary, [], 0

    def send(self, frame: dict) -> None:
        self.ws.send(encode(frame, self.binary))

    def recv(self) -> dict:
        data = self.ws.recv(timeout=120)
        assert isinstance(data, bytes) == self.binary      # answered in the encoding of the last frame
        return decode(data)

    def request(self, frame: dict) -> dict:
        self.ids += 1
        self.send({**frame, "id": self.ids})
        while (answer := self.recv()).get("id") != self.ids:
            self.events.append(answer)
        return answer

    def next(self) -> dict:
        """The next frame that is no answer to a request."""
        return self.events.pop(0) if self.events else self.recv()

    def until(self, last: str) -> list[dict]:
        """Frames up to and including the first of type `last`."""
        frames = [self.next()]
        while frames[-1]["type"] != last:
            frames.append(self.next())
        return frames

    def launch(self, source: str, input: dict | None = None, **options) -> dict:
        assert self.request({"type": "upload", "program": {"source": source}})["type"] == "uploaded"
        return self.request({"type": "launch", "hash": program_hash(Program(source=source)), "input": input or {},
                             **options})

    def close(self) -> None:
        self.ws.close()


def _wait_for(predicate, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)
    return value


def _row(conn: Conn, process: str) -> dict | None:
    return next((p for p in conn.request({"type": "ps"})["processes"] if p["process"] == process), None)


def test_detach_and_reattach_get_every_message_in_order_once(server):
    first = Conn(server)                                   # JSON
    launched = first.launch(COUNTER)
    assert launched["type"] == "launched" and len(launched["process"]) >= 20
    pid = launched["process"]
    first.request({"type": "send", "process": pid, "message": 3})
    frames = [first.next() for _ in range(3)]
    first.send({"type": "send", "process": pid, "message": 5})       # detaching while it sends
    first.send({"type": "detach", "process": pid})
    frames += [f for f in first.until("detached") if f["type"] == "text"]
    assert first.request({"type": "send", "process": pid, "message": 3}) == {"type": "ok", "id": first.ids}
    kept = 3 + 5 + 3 - len(frames)
    assert _wait_for(lambda: _row(first, pid)["buffered"] == kept)
    assert _row(first, pid)["attached"] is False and first.events == []

    second = Conn(server, binary=True)                     # msgpack
    assert second.request({"type": "attach", "process": pid}) == \
        {"type": "attached", "process": pid, "name": launched["name"], "id": 1}
    frames += [second.next() for _ in range(kept)]
    second.request({"type": "send", "process": pid, "message": 2})
    second.request({"type": "send", "process": pid, "message": 0})
    frames += second.until("done")
    *texts, done = frames
    assert [f["seq"] for f in frames] == list(range(14))
    assert [json.loads(f["text"]) for f in texts] == [{"n": n} for n in range(13)]
    assert all(f["process"] == pid and f["type"] == "text" for f in texts)
    assert done["output"] == {"sent": 13}
    assert _row(second, pid) is None                       # its end was read: forgotten
    first.close()
    second.close()


def test_a_process_does_not_exist_under_another_key(server):
    mine = Conn(server)
    pid = mine.launch(HOLDER, name="agent")["process"]
    assert mine.until("text")[-1]["text"] == "ready"
    theirs = Conn(server, key=None)
    assert theirs.request({"type": "ps"})["code"] == "missing_key"
    assert theirs.request({"type": "auth", "key": OTHER}) == {"type": "ok", "id": 2}
    assert theirs.request({"type": "ps"})["processes"] == []
    for request in ({"type": "attach"}, {"type": "detach"}, {"type": "send", "message": "hi"},
                    {"type": "send_file", "data": "aGk="}, {"type": "kill"}, {"type": "wait"}):
        for process in (pid, "no-such-process"):
            answer = theirs.request({**request, "process": process})
            assert (answer["code"], answer["message"]) == ("not_found", f"no process {process!r}"), request
    # its uploads are its own, and so are process names: its send_to does not reach mine
    again = theirs.request({"type": "launch", "hash": program_hash(Program(source=HOLDER))})
    assert again["code"] == "not_found"
    sender = theirs.launch(SEND_TO, {"to": "agent"})
    failed = theirs.until("failed")[-1]
    assert failed["process"] == sender["process"] and "no running inferlet named 'agent'" in failed["message"]
    own = theirs.launch(HOLDER, name="agent")
    assert own["name"] == "agent" and theirs.until("text")[-1]["text"] == "ready"
    theirs.request({"type": "kill", "process": own["process"]})
    assert theirs.until("failed")[-1]["kind"] == "cancelled"
    theirs.close()
    # the process never noticed
    assert [p["process"] for p in mine.request({"type": "ps"})["processes"]] == [pid]
    mine.request({"type": "send", "process": pid, "message": "still mine"})
    assert mine.until("done")[-1]["output"] == {"got": "still mine"}
    mine.close()
    bad = Conn(server, key="not-a-key")
    assert bad.recv()["code"] == "invalid_key"
    with pytest.raises(ConnectionClosed) as closed:
        bad.recv()
    assert closed.value.rcvd.code == 1008


BAD_FRAMES = [
    ("not json", "bad_frame"),
    (b"\xc1", "bad_frame"),                                          # never valid msgpack
    ("[1, 2]", "bad_frame"),
    ('{"no": "type"}', "bad_frame"),
    ('{"type": "fly", "id": 7}', "bad_frame"),
    ('{"type": "send", "id": 8}', "bad_frame"),
    ('{"type": "kill", "process": 5, "id": 9}', "bad_frame"),
    ('{"type": "launch", "hash": "x", "detach": "yes", "id": 10}', "bad_frame"),
    ('{"type": "launch", "hash": "x", "timeout": -1, "id": 11}', "bad_frame"),
    ('{"type": "launch", "hash": "x", "files": {"f": "not base64!"}, "id": 12}', "bad_frame"),
    ('{"type": "upload", "program": {"bundle": {"../main.py": "x"}}, "id": 13}', "bad_frame"),
    ('{"type": "upload", "program": {"bundle": {"helper.py": "x"}}, "id": 14}', "bad_frame"),
    ('{"type": "upload", "program": {"bundle": {"main.py": "x"}, "language": "javascript", "entry": "main.py"}, '
     '"id": 17}', "bad_frame"),                                      # a JavaScript bundle of .py files
    ('{"type": "upload", "program": {"bundle": {"a.js": "x"}, "language": "javascript", "entry": "b.js"}, "id": 18}',
     "bad_frame"),                                                   # an entry it does not hold
    ('{"type": "upload", "program": {"bundle": {"main.py": "x"}, "entry": "main.py"}, "id": 19}', "bad_frame"),
    ('{"type": "upload", "program": {"bundle": {"main.rb": "x"}, "language": "ruby"}, "id": 20}', "bad_frame"),
    ('{"type": "launch", "hash": "0123", "id": 15}', "not_found"),
    ('{"type": "auth", "key": "' + KEY + '", "id": 16}', "invalid_request"),   # it has its key
]


def test_bad_frames_get_an_error_frame_and_change_nothing(server):
    runner = Conn(server)
    pid = runner.launch(HOLDER)["process"]
    assert runner.until("text")[-1]["text"] == "ready"
    prober = Conn(server, key=OTHER)
    for raw, code in BAD_FRAMES:
        prober.binary = isinstance(raw, bytes)
        prober.ws.send(raw)
        error = prober.recv()
        assert (error["type"], error["code"]) == ("error", code), (raw, error)
        sent = json.loads(raw) if isinstance(raw, str) and raw.startswith("{") else {}
        assert error.get("id") == sent.get("id")
    prober.binary = False
    assert prober.request({"type": "ps"})["processes"] == []           # still serving
    assert _row(runner, pid)["state"] == "running"
    runner.request({"type": "send", "process": pid, "message": {"after": "the bad frames"}})
    assert runner.until("done")[-1]["output"] == {"got": {"after": "the bad frames"}}
    prober.close()
    runner.close()


def test_past_the_detached_buffer_the_process_is_ended_and_says_why(server):
    conn = Conn(server, binary=True)
    pid = conn.launch(COUNTER, detach=True)["process"]
    for sent in range(1, LIMIT + 1):                       # one message at a time, each kept
        conn.request({"type": "send", "process": pid, "message": 1})
        assert _wait_for(lambda: _row(conn, pid)["buffered"] == sent)
    assert _row(conn, pid)["state"] == "running"
    conn.request({"type": "send", "process": pid, "message": 1})      # one more: the server ends it
    assert _wait_for(lambda: _row(conn, pid)["state"] == "failed")
    assert conn.request({"type": "send", "process": pid, "message": 1})["code"] == "invalid_request"
    conn.request({"type": "attach", "process": pid})
    *texts, failed = conn.until("failed")
    # everything it sent, in order, then why it ended
    assert [json.loads(f["text"]) for f in texts] == [{"n": n} for n in range(LIMIT + 1)]
    assert [f["seq"] for f in texts + [failed]] == list(range(LIMIT + 2))
    assert failed["kind"] == "cancelled" and f"more than {LIMIT} messages" in failed["message"]
    assert "serve.detached_buffer" in failed["message"]
    assert _row(conn, pid) is None
    conn.close()


def test_a_single_user_server_says_so_and_ends_idle_processes(default_model_dir, caplog):
    with caplog.at_level("WARNING", logger="pie.serve"), start(default_model_dir, idle_timeout_s=0.5) as open_server:
        assert any("single-user" in r.getMessage() for r in caplog.records)
        start_pages = idle(open_server)["kv"]["referenced"]
        conn = Conn(open_server, key=None)
        pid = conn.launch(HOLDER)["process"]
        assert conn.until("text")[-1]["text"] == "ready"
        assert open_server.runtime.stats()["kv"]["referenced"] > start_pages
        conn.close()                                       # detached: idle from now on
        stats = idle(open_server)
        assert stats["kv"]["referenced"] == start_pages and stats["sequences"] == 0
        later = Conn(open_server, key=None)
        assert later.request({"type": "ps"})["processes"] == []
        assert later.request({"type": "attach", "process": pid})["code"] == "not_found"
        later.close()
