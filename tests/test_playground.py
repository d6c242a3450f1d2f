"""The playground at / of pie serve, in a real browser (Debian's chromium driven by Playwright):
the quickstart streams into the page, a failure points at its line, a looping program is killed
and its pages return, eight programs at once show batched steps, keys keep their processes apart,
nothing leaves for another host, a program's text is never markup, and a dropped WebSocket offers
to re-attach. The README's screenshot (docs/playground.png) is taken mid-run here."""
from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from pie_actors.client import Client
from pie_actors.process import Send
from pie_actors.program import Program
from serve_helpers import KEY, idle, start

playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' brings playwright")

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "docs" / "playground.png"
OTHER = "other-key"
QUESTION = "What is the capital of France?"
WAIT_MS = 120_000

if shutil.which(CHROMIUM) is None:
    pytest.skip(f"{CHROMIUM} is missing: `make setup` installs it (apt-get install chromium), which needs root "
                "and Debian's archive", allow_module_level=True)

# greedy decoding of a fixed number of tokens (no stop), each sent as it comes: long enough for eight
# of them to share steps
DECODE = """from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    tokens, out = chat.user(input["question"]) + chat.cue_without_thinking(), []
    for _ in range(input["tokens"]):
        fwd = ForwardPass()
        fwd.embed(tokens)
        fwd.state([ws], StateGeometry.folding())
        nxt = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        tokens = [await nxt]
        out += tokens
        session.send(model.decode(tokens))
    pipe.close()
    return {"tokens": out}
"""

LOOP = DECODE.replace('range(input["tokens"])', "iter(int, 1)")     # forever, until killed

ECHO = """from inferlet import session

async def main(input):
    turns = 0
    while (message := await session.receive()) != "stop":
        turns += 1
        session.send(f"echo {message}\\n")
    return {"turns": turns}
"""

BROKEN = """from inferlet import session

async def main(input):
    x = (1,
    return x
"""

MARKUP = """from inferlet import session

async def main(input):
    session.send("<script>window.pwned = 1</script>")
    session.send('<img src="x" onerror="window.pwned = 2">')
    return {"html": "<b onmouseover='window.pwned = 3'>bold</b>"}
"""


@pytest.fixture(scope="module")
def server(default_model_dir):
    with start(default_model_dir, api_keys=(KEY, OTHER)) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


class Tab:
    """A page of the playground in its own browser context (its own sessionStorage), with every
    request to a host other than the server's refused and recorded in `elsewhere`."""

    def __init__(self, browser, url: str, key: str | None = KEY) -> None:
        self.url, self.origin = url, urlsplit(url).netloc
        # bypass_csp: Playwright evaluates its waits as strings, which the page's policy forbids
        self.context = browser.new_context(viewport={"width": 1500, "height": 1000}, bypass_csp=True)
        self.requests: list[str] = []
        self.elsewhere: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("websocket", lambda ws: self.requests.append(ws.url))
        self.page.goto(url + "/")
        if key is not None:
            self.enter_key(key)
            self.page.wait_for_function("document.querySelectorAll('#example option').length > 1")

    def _route(self, route) -> None:
        if urlsplit(route.request.url).netloc == self.origin:
            route.continue_()
        else:
            self.elsewhere.append(route.request.url)
            route.abort("blockedbyclient")

    def enter_key(self, key: str) -> None:
        self.page.get_by_label("API key").fill(key)
        self.page.get_by_role("button", name="Use key").click()

    def output(self) -> str:
        return self.page.locator("#output").text_content()

    def wait_output(self, text: str) -> None:
        self.page.wait_for_function("text => document.querySelector('#output').textContent.includes(text)", arg=text)

    def write(self, source: str) -> None:
        self.page.get_by_role("textbox", name="Program").fill(source)

    def add_input(self, name: str, value: str) -> None:
        self.page.get_by_role("button", name="Add input").click()
        self.page.get_by_label("input name").last.fill(name)
        self.page.get_by_role("textbox", name=name).fill(value)

    def kv(self, state: str) -> int:
        return int(self.page.locator(f'#kv tr[data-kv="{state}"] td').last.text_content())

    def wait_kv(self, state: str, value: int) -> None:
        self.page.wait_for_function(
            "([state, value]) => document.querySelector(`#kv tr[data-kv='${state}'] td:last-child`)"
            "?.textContent === String(value)", arg=[state, value])

    def process_rows(self) -> dict[str, list[str]]:
        """The live view's processes: id -> [name, state, attached]."""
        return self.page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#processes tbody tr')]
            .map(r => [r.dataset.process, [...r.cells].slice(0, 3).map(c => c.textContent)]))""")

    def run(self, source: str, name: str) -> None:
        """Run `source` from the page as process `name`."""
        self.write(source)
        self.start(name)

    def start(self, name: str) -> None:
        """Run the editor's program as process `name`."""
        self.page.get_by_label("Process name").fill(name)
        self.page.get_by_role("button", name="Run").click()

    def send(self, message: str) -> None:
        """Send `message` to the running process from the page."""
        self.page.get_by_label("Message").fill(message)
        self.page.get_by_role("button", name="Send").click()

    def wait_process(self, name: str, state: str = "running") -> str:
        """The id of this key's process `name` once the live view lists it in `state`."""
        self.page.wait_for_function(
            "([name, state]) => [...document.querySelectorAll('#processes tbody tr')].some("
            "r => r.cells[0].textContent === name && r.cells[1].textContent === state)", arg=[name, state])
        return next(pid for pid, row in self.process_rows().items() if row[:2] == [name, state])

    def next_stats(self) -> dict:
        """The next figures the live view fetches."""
        with self.page.expect_response(lambda r: r.url.endswith("/playground/stats")) as response:
            pass
        return response.value.json()

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser, server):
    tab = Tab(browser, server.url)
    yield tab
    tab.close()


def wait_for(predicate, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def reference(server, program: str, input: dict) -> tuple[str, dict]:
    """The streamed text and result of `program` launched on the server's runtime directly."""
    process = server.runtime.launch(Program(source=program), input)
    text = "".join(e.text for e in process.events() if isinstance(e, Send))
    return text, process.result()


def test_the_quickstart_streams_paris_then_its_result(tab, server):
    page = tab.page
    page.get_by_label("Example").select_option("quickstart")
    assert page.locator("#editor").get_attribute("data-language") == "python"
    assert "async def main" in page.get_by_role("textbox", name="Program").input_value()
    page.get_by_role("textbox", name="question").fill(QUESTION)
    # every state the output passes through, to see the text arrive in pieces before the result
    page.evaluate("""() => { window.seen = [];
        new MutationObserver(() => window.seen.push(document.querySelector('#output').textContent))
            .observe(document.querySelector('#output'), {childList: true, subtree: true, characterData: true}); }""")
    page.get_by_role("button", name="Run").click()
    tab.wait_output("Done")

    quickstart = (ROOT / "examples" / "quickstart" / "main.py").read_text()
    text, result = reference(server, quickstart, {"question": QUESTION})
    assert "Paris" in text
    assert tab.output() == text + "Done\n" + json.dumps(result, indent=2)
    seen = page.evaluate("window.seen")
    streaming = [s for s in seen if s and "Done" not in s]
    assert len(streaming) >= 3 and streaming[-1] == text          # piece by piece, then the result
    assert any("Paris" not in s for s in streaming) and "Paris" in streaming[-1]
    assert page.locator("#output").get_attribute("aria-live") == "polite"
    assert idle(server)["kv"]["referenced"] == 0


def test_javascript_examples_run_from_the_page_a_file_and_a_bundle(tab, server):
    """The JavaScript quickstart gives the Python quickstart's text; the JavaScript debate, a bundle
    whose judge spawns a module of its own, gives what the same bundle gives launched directly."""
    page = tab.page
    page.get_by_label("Example").select_option("js/quickstart")
    page.get_by_role("textbox", name="question").fill(QUESTION)
    page.get_by_role("button", name="Run").click()
    tab.wait_output("Done")
    quickstart = (ROOT / "examples" / "quickstart" / "main.py").read_text()
    text, result = reference(server, quickstart, {"question": QUESTION})
    assert tab.output() == text + "Done\n" + json.dumps(result, indent=2)

    page.get_by_label("Example").select_option("js/debate")
    page.get_by_role("textbox", name="rounds").fill("1")
    page.get_by_role("textbox", name="max_tokens").fill("4")
    page.get_by_role("button", name="Run").click()
    tab.wait_output("Done")
    debate = server.runtime.launch(Program.load(ROOT / "examples" / "js" / "debate"), {"rounds": 1, "max_tokens": 4})
    sent = [json.loads(e.text) for e in debate.events() if isinstance(e, Send)]
    want = debate.result()
    shown, _, result = tab.output().partition("Done\n")
    got = json.loads(result)        # the agents' names differ: each run's processes are named anew
    assert json.loads(shown) == sent[0] and len(sent) == 1
    assert (got["transcript"], got["verdict"]) == (want["transcript"], want["verdict"])
    assert idle(server)["kv"]["referenced"] == 0


def test_a_syntax_error_shows_its_line(tab, server):
    tab.write(BROKEN)
    tab.page.get_by_role("button", name="Run").click()
    tab.wait_output("Failed")
    output = tab.output()
    assert "Failed: exception" in output and "SyntaxError: '(' was never closed" in output
    assert "at main.py, line 4" in output
    assert tab.page.locator("#editor").get_attribute("data-error-line") == "4"
    assert tab.page.locator(".gutter .error-line").text_content() == "4"
    assert tab.page.locator(".code pre .error-line").text_content() == "    x = (1,\n"


def run_looper(tab: Tab, question: str) -> str:
    """Run LOOP from the page as "looper"; its id once it streams."""
    tab.write(LOOP)
    tab.add_input("question", question)
    tab.start("looper")
    pid = tab.wait_process("looper")
    tab.page.wait_for_function("document.querySelector('#output').textContent.length > 40")
    return pid


def kill_looper(tab: Tab, server) -> None:
    tab.page.get_by_role("button", name="Kill").click()
    tab.wait_output("Failed: cancelled")
    assert "killed by request (process 'looper')" in tab.output()
    assert tab.page.get_by_role("button", name="Kill").is_disabled()


def test_a_looping_program_is_killed_from_the_page_and_its_pages_return(tab, server):
    start_pages = idle(server)["kv"]
    run_looper(tab, QUESTION)
    tab.page.wait_for_function("Number(document.querySelector('#tokens-rate').textContent) > 0")
    assert tab.kv("referenced") > 0
    assert "Paris" in tab.output()                     # the question's answer, streaming on
    kill_looper(tab, server)
    assert idle(server)["kv"]["referenced"] == start_pages["referenced"] == 0
    tab.wait_kv("referenced", 0)
    tab.wait_kv("free", idle(server)["kv"]["free"])


def test_eight_programs_at_once_show_a_step_of_more_than_one_lane(tab, server):
    """Eight programs of this key launched by pie-client's Client, and one from the page; the
    README's screenshot is taken while they run."""
    stats = idle(server)
    input = {"question": QUESTION, "tokens": 24}
    text, result = reference(server, DECODE, input)
    assert tab.page.locator("#largest-step").text_content() in ("0", "1")     # nothing batched since it opened
    assert tab.page.locator("#compile").text_content() == "eager (nothing to compile)" and \
        stats["compile"]["total"] == 0
    run_looper(tab, "Tell me a long story about Paris.")
    with Client(server.url, api_key=KEY) as client, ThreadPoolExecutor(8) as pool:
        processes = [client.submit(DECODE, input, name=f"decode-{i}") for i in range(8)]
        results = pool.map(lambda p: p.result(), processes)
        tab.page.wait_for_function("Number(document.querySelector('#largest-step').textContent) > 1")
        SCREENSHOT.parent.mkdir(exist_ok=True)
        tab.page.screenshot(path=str(SCREENSHOT))      # the README's picture, mid-run
        assert list(results) == [result] * 8           # batching changes no token
    lanes = tab.page.evaluate("[...document.querySelectorAll('#lanes .bar')].map(b => Number(b.dataset.lanes))")
    assert max(lanes) > 1
    kill_looper(tab, server)
    assert idle(server)["kv"]["referenced"] == 0
    tab.wait_kv("referenced", 0)


def test_a_wrong_key_gets_the_servers_error(browser, server):
    answer = httpx.get(server.url + "/playground/stats", headers={"Authorization": "Bearer wrong"})
    assert answer.status_code == 401
    tab = Tab(browser, server.url, key=None)
    try:
        assert tab.page.get_by_role("alert").text_content() == httpx.get(server.url + "/playground/stats").json()[
            "error"]["message"]                        # no key yet: the server's own words
        tab.enter_key("wrong")
        tab.page.wait_for_function("document.querySelector('#key-error').textContent.includes('not valid')")
        assert tab.page.get_by_role("alert").text_content() == answer.json()["error"]["message"]
        assert tab.page.evaluate("sessionStorage.length") == 0
        tab.enter_key(KEY)
        tab.page.wait_for_function("document.querySelectorAll('#example option').length > 1")
        assert tab.page.locator("#key-form").is_hidden()
        assert tab.page.evaluate("sessionStorage.getItem('pie-api-key')") == KEY
        assert tab.context.cookies() == [] and KEY not in tab.page.url
        assert not any(KEY in url for url in tab.requests)
    finally:
        tab.close()


def test_two_keys_in_two_tabs_never_see_each_others_processes(browser, server):
    mine, theirs = Tab(browser, server.url, KEY), Tab(browser, server.url, OTHER)
    try:
        for tab, name in ((mine, "alpha"), (theirs, "beta")):
            tab.run(ECHO, name)
        alpha, beta = mine.wait_process("alpha"), theirs.wait_process("beta")
        for tab, own, other in ((mine, alpha, beta), (theirs, beta, alpha)):
            figures = tab.next_stats()                 # a reading taken while both run
            assert [p["process"] for p in figures["processes"]] == [own]
            assert list(tab.process_rows()) == [own] and other not in json.dumps(figures)
        for tab, name in ((mine, "alpha"), (theirs, "beta")):
            tab.send("stop")
            tab.wait_output('"turns": 0')
    finally:
        mine.close()
        theirs.close()
    assert idle(server)["kv"]["referenced"] == 0


def test_the_page_needs_nothing_but_the_server(tab, server):
    """Every request of the page, the WebSocket included, goes to the server; any other is refused."""
    tab.page.get_by_label("Example").select_option("quickstart")
    tab.next_stats()
    assert tab.elsewhere == []
    assert tab.requests and {urlsplit(url).netloc for url in tab.requests} == {tab.origin}
    assert any(url.endswith("/v1/ws") for url in tab.requests)
    assert tab.page.evaluate("getComputedStyle(document.body).fontFamily")      # styled by its own CSS
    policy = httpx.get(server.url + "/").headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy


def test_a_programs_markup_is_shown_as_text(tab, server):
    tab.write(MARKUP)
    tab.page.get_by_role("button", name="Run").click()
    tab.wait_output("Done")
    output = tab.output()
    assert output.startswith('<script>window.pwned = 1</script><img src="x" onerror="window.pwned = 2">Done')
    assert "<b onmouseover='window.pwned = 3'>bold</b>" in output
    assert tab.page.locator("#output script, #output img, #output b").count() == 0
    assert tab.page.evaluate("window.pwned") is None


def test_the_editor_follows_the_files_language(tab):
    page = tab.page
    page.get_by_label("Example").select_option("js/quickstart")
    assert page.locator("#editor").get_attribute("data-language") == "javascript"
    assert page.locator("#language").text_content() == "JavaScript"
    assert "const" in page.locator(".code pre .tok-keyword").all_text_contents()
    page.get_by_label("Example").select_option("agents/debate")            # a bundle: a tab per file
    assert page.get_by_role("tab").all_text_contents() == ["agent.py", "main.py", "speak.py"]
    assert page.locator("#editor").get_attribute("data-language") == "python"
    assert "async" in page.locator(".code pre .tok-keyword").all_text_contents()
    page.get_by_role("tab", name="agent.py").click()
    assert page.get_by_role("textbox", name="Program").input_value() == \
        (ROOT / "examples" / "agents" / "debate" / "agent.py").read_text()


def test_a_detached_process_is_attached_from_another_tab_of_the_key(browser, server):
    first, second = Tab(browser, server.url), Tab(browser, server.url)
    try:
        first.run(ECHO, "echo")
        pid = first.wait_process("echo")
        first.send("one")
        first.wait_output("echo one")
        first.close()                                  # its connection closes: the process runs on, detached
        second.wait_process("echo")
        second.page.get_by_role("button", name="Attach echo").click()
        second.send("two")
        second.wait_output("echo two")
        second.send("stop")
        second.wait_output('"turns": 2')
        assert "echo one" not in second.output()       # it reached the first tab, and is not sent twice
        assert pid not in [p["process"] for p in second.next_stats()["processes"]]   # ended, forgotten
    finally:
        second.close()
    assert idle(server)["kv"]["referenced"] == 0


class Proxy:
    """A TCP proxy to the server whose open connections `drop()` cuts, as a network that fails."""

    def __init__(self, target: str) -> None:
        host, port = urlsplit(target).hostname, urlsplit(target).port
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client = self.listener.accept()[0]
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def drop(self) -> None:
        with self.lock:
            dropped, self.open = self.open, []
        for s in dropped:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
        self.drop()


def test_a_dropped_websocket_shows_disconnected_and_reattaches(browser, server):
    proxy = Proxy(server.url)
    tab = Tab(browser, proxy.url)
    try:
        tab.run(ECHO, "echo")
        pid = tab.wait_process("echo")
        tab.send("one")
        tab.wait_output("echo one")

        proxy.drop()
        tab.page.get_by_role("status").filter(has_text="disconnected").first.wait_for()
        assert tab.page.locator("#run-state").text_content() == "disconnected"
        reattach = tab.page.get_by_role("button", name="Re-attach")
        assert reattach.is_visible()
        with Client(server.url, api_key=KEY) as client:      # it runs on, detached, and keeps what it sends
            row = next(p for p in client.ps() if p["process"] == pid)
            assert row["state"] == "running"
            client.send(pid, "two")
            wait_for(lambda: next(p for p in client.ps() if p["process"] == pid)["buffered"] == 1)
        reattach.click()
        tab.wait_output("echo two")
        assert reattach.is_hidden()
        tab.send("stop")
        tab.wait_output('"turns": 2')
        assert tab.output().count("echo one") == 1 and tab.output().count("echo two") == 1
    finally:
        tab.close()
        proxy.close()
    assert idle(server)["kv"]["referenced"] == 0


def test_the_examples_inputs_are_read_from_their_mains():
    from pie_actors.serve.playground.examples import examples, javascript_inputs, python_inputs

    found = {e["name"]: e for e in examples()}
    assert found["quickstart"]["inputs"] == found["js/quickstart"]["inputs"] == [{"name": "question", "required": True}]
    assert found["quickstart"]["files"] == {"main.py": (ROOT / "examples" / "quickstart" / "main.py").read_text()}
    assert set(found["agents/debate"]["files"]) == {"agent.py", "main.py", "speak.py"}
    python = 'n = input.get("n", 4)\ns = input.get("s", "it\'s")\nx = input.get("x", DEFAULT)\nq = input["q"]\n'
    javascript = "const n = input.n ?? 4, s = input.s ?? 'it\\'s', x = input.x ?? DEFAULT, q = input['q'];"
    expected = [{"name": "n", "required": False, "default": 4}, {"name": "s", "required": False, "default": "it's"},
                {"name": "x", "required": False}, {"name": "q", "required": True}]
    assert python_inputs(python) == javascript_inputs(javascript) == expected
    assert python_inputs("def main(:\n") == []                 # a file that does not parse offers no inputs


def test_the_pages_routes_while_the_engine_loads():
    """Before the engine serves, the page loads and its figures say so; the figures need the key,
    the page and its files do not."""
    from starlette.testclient import TestClient

    from pie_actors.serve.app import build_app
    from pie_actors.serve.metrics import Metrics
    from pie_actors.serve.routes import Serving
    from pie_actors.serve.sessions import Sessions

    loading = Serving("smollm2", ("default",), Metrics(), Sessions(600, 16))
    with TestClient(build_app(loading, (KEY,))) as app:
        page = app.get("/")
        assert page.status_code == 200 and page.text == app.get("/playground").text
        assert '<button id="run" type="button" class="primary">Run</button>' in page.text
        assert app.get("/playground/assets/playground.js").headers["content-type"].startswith("text/javascript")
        missing = app.get("/playground/assets/secrets.txt")
        assert missing.status_code == 404 and "'secrets.txt'" in missing.json()["error"]["message"]
        assert app.get("/playground/stats").status_code == 401
        figures = app.get("/playground/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert figures["status"] == "loading" and figures["processes"] == [] and figures["model"] == "smollm2"
