"""http.fetch from an inferlet against a local HTTP server started here: allowed requests come back
whole (status, headers, body) and run beside the inferlet's other tasks; refused ones (no allow-list,
a host not on it, a private address under "*", a redirect off the list), a timeout and an oversized
body each raise http.HttpError with its kind. The dummy model: no tokens matter here."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from inferlet_helpers import pages_return
from pie_actors import Runtime

FETCH = """
import asyncio, json
from inferlet import http

async def main(input):
    async def one(request):
        try:
            r = await http.fetch(**request)
        except http.HttpError as e:
            return {"error": e.kind, "message": str(e)}
        return {"status": r.status, "body": r.text, "type": r.headers.get("content-type"), "url": r.url}
    return await asyncio.gather(*(one(r) for r in input["requests"]))
"""


class _Handler(BaseHTTPRequestHandler):
    in_flight = 0
    most_in_flight = 0
    paths: list[str] = []
    lock = threading.Lock()

    def do_GET(self):
        cls = type(self)
        cls.paths.append(self.path)
        with cls.lock:
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            if self.path.startswith("/slow"):
                time.sleep(float(self.path.split("=")[1]))
                self._reply(200, b"slow")
            elif self.path == "/big":
                self._reply(200, b"x" * (2 << 20))
            elif self.path.startswith("/to/"):
                self.send_response(302)
                self.send_header("Location", self.path[len("/to/"):].replace("~", "/"))
                self.end_headers()
            else:
                self._reply(200, json.dumps({"path": self.path}).encode(), "application/json")
        finally:
            with cls.lock:
                cls.in_flight -= 1

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        self._reply(201, json.dumps({"got": body.decode(), "token": self.headers.get("x-token")}).encode(),
                    "application/json")

    def _reply(self, status: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def runtime(default_model_dir):
    with Runtime.local("dummy", dtype="float32", num_pages=64, compile="off", timeout_s=60,
                       http_timeout_s=5.0, http_response_mb=1) as rt:
        with pages_return(rt):
            yield rt


def _fetch(runtime: Runtime, requests: list[dict], allow: tuple[str, ...]) -> list[dict]:
    limits = dataclasses.replace(runtime.config.limits, allow_hosts=allow)
    return runtime.launch(FETCH, {"requests": requests}, limits=limits).result(300)


def test_an_allowed_host_answers_with_status_headers_and_body(runtime, server):
    got = _fetch(runtime, [{"url": f"{server}/hello?x=1"},
                           {"url": f"{server}/echo", "method": "POST", "body": "ping", "headers": {"x-token": "t"}}],
                 ("127.0.0.1",))
    assert got[0] == {"status": 200, "body": '{"path": "/hello?x=1"}', "type": "application/json",
                      "url": f"{server}/hello?x=1"}
    assert got[1]["status"] == 201 and json.loads(got[1]["body"]) == {"got": "ping", "token": "t"}


def test_requests_run_side_by_side_without_blocking_the_inferlet(runtime, server):
    _Handler.most_in_flight = 0
    got = _fetch(runtime, [{"url": f"{server}/slow?s=0.5"}] * 3, ("127.0.0.1",))
    assert [g["body"] for g in got] == ["slow"] * 3
    assert _Handler.most_in_flight == 3          # all three were at the server at once


def test_no_allow_list_refuses_every_request_naming_the_setting(runtime, server):
    [got] = _fetch(runtime, [{"url": f"{server}/hello"}], ())
    assert got["error"] == "refused" and "allow_hosts" in got["message"] and "--allow-host" in got["message"]


def test_a_host_not_on_the_list_is_refused(runtime, server):
    [got] = _fetch(runtime, [{"url": f"{server}/hello"}], ("example.com",))
    assert got["error"] == "refused" and "'127.0.0.1'" in got["message"] and "not in" in got["message"]


def test_private_addresses_need_the_host_named_itself(runtime, server):
    port = server.rsplit(":", 1)[1]
    got = _fetch(runtime, [{"url": f"{server}/hello"}, {"url": f"http://localhost:{port}/hello"}], ("*",))
    assert [g["error"] for g in got] == ["refused", "refused"]
    assert "private or this cluster's own address" in got[1]["message"]
    [named] = _fetch(runtime, [{"url": f"http://localhost:{port}/hello"}], ("localhost",))
    assert named["status"] == 200


def test_a_redirect_off_the_list_is_refused(runtime, server):
    port = server.rsplit(":", 1)[1]
    on_list, off_list = f"{server}/to/~hello", f"{server}/to/http:~~localhost:{port}~hello"
    got = _fetch(runtime, [{"url": on_list}, {"url": off_list}], ("127.0.0.1",))
    assert got[0]["status"] == 200 and got[0]["url"] == f"{server}/hello"
    assert got[1]["error"] == "refused" and "'localhost'" in got[1]["message"]


def test_a_slow_answer_times_out(runtime, server):
    [got] = _fetch(runtime, [{"url": f"{server}/slow?s=3", "timeout": 0.5}], ("127.0.0.1",))
    assert got["error"] == "timeout" and "0.5 s" in got["message"]


def test_an_oversized_body_is_refused(runtime, server):
    [got] = _fetch(runtime, [{"url": f"{server}/big"}], ("127.0.0.1",))
    assert got["error"] == "too_large" and "http_response_mb" in got["message"]


def test_pie_run_allow_host_opens_one_run(default_model_dir, server, tmp_path):
    prog = tmp_path / "fetch.py"
    prog.write_text("from inferlet import http\n\nasync def main(input):\n"
                    f"    return (await http.fetch({server + '/cli'!r})).json()\n")
    pie = Path(sys.executable).parent / "pie"
    env = dict(os.environ, PIE_HOME=str(default_model_dir.parent.parent))
    run = [str(pie), "run", "--local", "--model", "dummy", "--dtype", "float32", "--compile", "off"]
    refused = subprocess.run([*run, str(prog)], capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 1 and "allow_hosts" in refused.stderr
    allowed = subprocess.run([*run, "--allow-host", "127.0.0.1", str(prog)], capture_output=True, text=True,
                             timeout=300, env=env)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert json.loads(allowed.stdout.strip().splitlines()[-1]) == {"path": "/cli"}


def test_a_name_that_rebinds_to_a_private_address_after_the_check_is_not_reached(runtime, server, monkeypatch):
    """A hostile DNS answers a public address to the check and loopback after it: the request goes to
    the checked address (nothing listens there), never to the local server."""
    port = int(server.rsplit(":", 1)[1])
    answers = []
    real = socket.getaddrinfo

    def rebinding(host, *args, **kwargs):
        if host not in ("rebind.test", b"rebind.test"):     # anyio asks in bytes
            return real(host, *args, **kwargs)
        answers.append("93.184.215.14" if not answers else "127.0.0.1")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[-1], port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    _Handler.paths = []
    [got] = _fetch(runtime, [{"url": f"http://rebind.test:{port}/rebind", "timeout": 1.0}], ("*",))
    assert answers[0] == "93.184.215.14"
    assert got["error"] in ("failed", "timeout") and "/rebind" not in _Handler.paths


def test_a_request_still_in_flight_when_the_run_ends_ends_with_it(runtime, server):
    """The runs of a process share one host loop: a fetch the program left running is cancelled there
    when the run ends, not left to run out its timeout."""
    import asyncio

    from pie_actors.inferlet.run_state import host_loop

    program = ("import asyncio\nfrom inferlet import http\n\nasync def main(input):\n"
               f"    asyncio.ensure_future(http.fetch({server + '/slow?s=3'!r}, timeout=10))\n"
               "    await asyncio.sleep(0.5)\n    return {}\n")

    async def fetches_cancelled() -> list[bool]:
        """Whether each fetch task still on the loop ends cancelled (one left running would end by the
        slow reply, 3 s after it began, and not cancelled)."""
        tasks = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "HttpOps._fetch"]
        if tasks:
            await asyncio.wait(tasks)
        return [t.cancelled() for t in tasks]

    limits = dataclasses.replace(runtime.config.limits, allow_hosts=("127.0.0.1",))
    _Handler.paths = []
    assert runtime.launch(program, limits=limits).result(60) == {}
    assert "/slow?s=3" in _Handler.paths               # the request had reached the server
    assert all(asyncio.run_coroutine_threadsafe(fetches_cancelled(), host_loop()).result(30))
