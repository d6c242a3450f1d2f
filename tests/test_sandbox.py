"""The WebAssembly sandbox: the runner component, the host boundary, the guest event loop,
limits and failures, the compiled-component cache, and bundles.

The runner is built once (about 20 s on 2 cores) into $PIE_HOME/cache/inferlet/ and reused
from there by later runs, so a warm run of this file takes a few seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from pie_actors.config import RunLimits
from pie_actors.inferlet import build as build_mod
from pie_actors.inferlet import HostApi, InferletError, Sandbox, build_bundle, wasm_imports
from pie_actors.inferlet.build import bundle_modules, fits_runner

LIMITS = RunLimits(timeout_s=30, memory_mb=256)


class FakeHost(HostApi):
    """A host with two test operations: `echo` (returns its args) and `sleep` (a host future
    completed after args["ms"] milliseconds with args["value"]), plus `session.receive`."""

    def __init__(self, inbox=()):
        super().__init__()
        self.sent: list[str] = []
        self.inbox = list(inbox)
        self.calls: list[tuple[str, object, int]] = []    # (op, args, messages sent so far)
        self.resolved: list[object] = []                  # sleep values in completion order
        self.exited: list[InferletError | None] = []
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()

    def call(self, op, args):
        self.calls.append((op, args, len(self.sent)))
        if op == "echo":
            return args
        if op == "sleep":
            return self._later(args["ms"] / 1000, args.get("value"))
        if op == "session.receive":
            return self._later(0.0, self.inbox.pop(0))
        return super().call(op, args)

    def _later(self, delay, value):
        fid = self.futures.new()

        def fire():
            with self._lock:
                self.resolved.append(value)
            self.futures.resolve(fid, value)

        timer = threading.Timer(delay, fire)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()
        return fid

    def send(self, message):
        self.sent.append(message)

    def on_exit(self, error):
        self.exited.append(error)
        for timer in self._timers:
            timer.cancel()


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    t0 = time.perf_counter()
    sb = Sandbox(limits=LIMITS)
    art = sb.artifact
    print(f"\nrunner: from_cache={art.from_cache} build={art.build_s:.1f}s compile={art.compile_s:.1f}s "
          f"deserialize={sb.deserialize_s * 1000:.1f}ms sandbox={time.perf_counter() - t0:.2f}s")
    return sb


def run_ok(sandbox: Sandbox, source: str, input=None, api: FakeHost | None = None, **kw):
    api = api or FakeHost()
    out = sandbox.run(source, input if input is not None else {}, api, **kw)
    assert api.exited == [None]
    return out, api


def run_fail(sandbox: Sandbox, source: str, input=None, api: FakeHost | None = None, **kw) -> InferletError:
    api = api or FakeHost()
    with pytest.raises(InferletError) as info:
        sandbox.run(source, input if input is not None else {}, api, **kw)
    assert api.exited == [info.value]       # the host was told, so it can free the run's state
    return info.value


ROUND_TRIP = """
from inferlet import _host

ECHO = _host.call("echo", {"at": "import"})       # module-level code may call the host

async def main(input: dict) -> dict:
    return {"question": input["question"], "n": input["n"] + 1, "echo": ECHO,
            "unicode": "é∑🙂", "nested": {"list": [1, 2.5, None, True]}}
"""


def test_round_trip_json_and_module_level_host_call(sandbox):
    stats: dict = {}
    out, api = run_ok(sandbox, ROUND_TRIP, {"question": "capital of France?", "n": 41}, stats=stats)
    assert out == {"question": "capital of France?", "n": 42, "echo": {"at": "import"},
                   "unicode": "é∑🙂", "nested": {"list": [1, 2.5, None, True]}}
    assert api.calls == [("echo", {"at": "import"}, 0)]
    print(f"\ntrivial run: instantiate {stats['instantiate_s'] * 1000:.2f} ms, run {stats['run_s'] * 1000:.2f} ms")


def test_session_send_streams_in_order_while_running(sandbox):
    source = """
from inferlet import _host, session

async def main(input):
    for i in range(3):
        session.send(f"part{i} ")
        await _host.call_async("sleep", {"ms": 1, "value": i})   # the host notes what it has seen
    session.send({"done": True})
    return {"reply": await session.receive()}
"""
    out, api = run_ok(sandbox, source, api=FakeHost(inbox=["from client"]))
    assert api.sent == ["part0 ", "part1 ", "part2 ", '{"done": true}']
    # each message had reached the host before the guest's next host call: streamed, not batched
    assert [seen for op, _, seen in api.calls if op == "sleep"] == [1, 2, 3]
    assert out == {"reply": "from client"}


def test_gather_runs_host_calls_concurrently(sandbox):
    source = """
import asyncio
from inferlet import _host

async def main(input):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    values = await asyncio.gather(*(_host.call_async("sleep", {"ms": ms, "value": ms})
                                    for ms in (300, 100, 200)))
    t1 = loop.time()
    await asyncio.sleep(0.05)
    return {"values": values, "gather_s": t1 - t0, "sleep_s": loop.time() - t1}
"""
    out, api = run_ok(sandbox, source)
    assert out["values"] == [300, 100, 200]            # gather keeps argument order
    assert api.futures.max_open == 3                   # all three were in flight at once
    assert api.resolved == [100, 200, 300]             # and completed by their own delays
    assert out["sleep_s"] >= 0.05                      # asyncio.sleep waits (in the host)


def test_host_errors_reach_the_guest_as_host_error(sandbox):
    source = """
from inferlet import _host, HostError

async def main(input):
    try:
        _host.call("no-such-op", [1])
    except HostError as e:
        return {"error": str(e)}
"""
    out, _ = run_ok(sandbox, source)
    assert "no-such-op" in out["error"] and "unknown host operation" in out["error"]


# every import and value kind of the host interface: empty and non-ASCII strings both ways, an
# error result, poll, a wait-any with a timeout (u32) and without, and send
EVERY_IMPORT = """
import asyncio
from inferlet import _host, HostError, session
from wit_world.imports import host as _wit

async def main(input):
    session.send("")
    session.send("é∑🙂 " * 3)
    out = {"echo": _host.call("echo", {"": "", "ü": ["日本", 1.5]}), "poll": _wit.poll("[]"),
           "timeout": _wit.wait_any("[]", 1)}
    try:
        _host.call("no-such-op", "")
    except HostError as e:
        out["error"] = str(e)
    out["slept"] = await _host.call_async("sleep", {"ms": 1, "value": "ö"})
    return out
"""
SAME_RUN_GENERIC = """
import json, sys
from tests.test_sandbox import EVERY_IMPORT, FakeHost
from pie_actors.inferlet import Sandbox, wasm_imports
assert not wasm_imports.DIRECT
api = FakeHost()
print(json.dumps([Sandbox().run(EVERY_IMPORT, {}, api), api.sent]))
"""


def test_the_direct_import_glue_converts_as_wasmtime_py_does(sandbox):
    """wasm_imports registers the host imports with the C API (the default); the same run through
    wasmtime-py's generic add_func (PIE_WASM_IMPORTS=generic, in a fresh process) gives the same."""
    assert wasm_imports.DIRECT
    out, api = run_ok(sandbox, EVERY_IMPORT)
    assert out["echo"] == {"": "", "ü": ["日本", 1.5]} and out["poll"] == "{}" and out["timeout"] == "{}"
    assert "unknown host operation" in out["error"] and out["slept"] == "ö"
    assert api.sent == ["", "é∑🙂 " * 3]
    generic = subprocess.run([sys.executable, "-c", SAME_RUN_GENERIC], capture_output=True, text=True,
                             env={**os.environ, "PIE_WASM_IMPORTS": "generic"}, cwd=Path(__file__).parent.parent,
                             timeout=120)
    assert generic.returncode == 0, generic.stderr
    assert json.loads(generic.stdout.strip().splitlines()[-1]) == [out, api.sent]


def test_random_is_seeded_per_run(sandbox):
    source = "import random\nasync def main(input):\n    return random.random()\n"
    assert run_ok(sandbox, source)[0] != run_ok(sandbox, source)[0]


def test_exception_carries_guest_traceback_then_next_run_works(sandbox):
    source = """
def helper(x):
    return {"a": 1}[x]          # the failing line

async def main(input):
    return helper("missing")
"""
    err = run_fail(sandbox, source)
    assert err.kind == "exception"
    assert err.message == "KeyError: 'missing'"
    assert 'File "main.py", line 3, in helper' in err.guest_traceback
    assert 'return {"a": 1}[x]          # the failing line' in err.guest_traceback
    assert "pie_runner" not in err.guest_traceback     # the runner's own frames are trimmed
    assert run_ok(sandbox, ROUND_TRIP, {"question": "q", "n": 0})[0]["n"] == 1


def test_a_main_module_is_compiled_once_and_later_runs_are_handed_its_code(sandbox):
    source = f"# {uuid.uuid4()}\n" + """
def helper(x):
    return {"a": 1}[x]          # the failing line

async def main(input):
    return helper(input["key"])
"""
    seen = []
    for key in ("a", "a", "missing", "a"):
        stats = {}
        if key == "a":
            assert run_ok(sandbox, source, {"key": key}, stats=stats)[0] == 1
        else:         # the handed-over code still points its traceback at the source's lines
            err = run_fail(sandbox, source, input={"key": key}, stats=stats)
            assert 'File "main.py", line 4, in helper' in err.guest_traceback
            assert 'return {"a": 1}[x]          # the failing line' in err.guest_traceback
        seen.append(stats["main_cached"])
    assert seen == [False, True, True, True]

    broken = f"# {uuid.uuid4()}\nasync def main(input):\n    return (\n"
    for _ in range(2):                      # nothing compiled, nothing kept: it fails the same
        stats = {}
        assert "SyntaxError" in run_fail(sandbox, broken, stats=stats).message
        assert stats["main_cached"] is False


def test_a_sandbox_keeps_the_code_of_the_main_modules_run_last():
    sandbox = Sandbox(limits=LIMITS, codes_kept=2)
    first, second, third = (f"async def main(input):\n    return {n}\n" for n in range(3))
    cached = []
    for source in (first, second, first, third, second, first):
        stats = {}
        run_ok(sandbox, source, stats=stats)
        cached.append(stats["main_cached"])
    # the third evicts the second (the first ran after it), which then evicts the first
    assert cached == [False, False, True, False, False, False]


def test_an_inferlet_cannot_hand_over_code_of_its_own(sandbox):
    """The host keeps only the runner's compile, handed over before the inferlet's code runs: one
    that calls the import itself, at import or in main, changes nothing a later run gets."""
    evil = "async def main(input):\n    return 'replaced'\n"
    source = f"# {uuid.uuid4()}\n" + """
import base64, marshal
from wit_world.imports import host

def hand_over(text):
    host.compiled(base64.b64encode(marshal.dumps(compile(text, "main.py", "exec"))).decode())

hand_over(EVIL)

async def main(input):
    hand_over(EVIL)
    return "mine"
""".replace("EVIL", repr(evil))
    for cached in (False, True, True):
        stats = {}
        assert run_ok(sandbox, source, stats=stats)[0] == "mine"
        assert stats["main_cached"] is cached


def test_a_bundles_main_module_is_compiled_once_on_the_runner(sandbox):
    modules = bundle_modules({"main.py": f"# {uuid.uuid4()}\nfrom pkg import sub\n"
                                         "async def main(input):\n    return sub.twice(input['n'])\n",
                              "pkg/__init__.py": "", "pkg/sub.py": "def twice(n):\n    return 2 * n\n"})
    seen = []
    for n in (1, 2):
        stats = {}
        assert run_ok(sandbox, "", {"n": n}, bundle=modules, stats=stats)[0] == 2 * n
        seen.append(stats["main_cached"])
    assert seen == [False, True]


def test_infinite_loop_times_out_then_next_run_works(sandbox):
    source = "async def main(input):\n    while True:\n        pass\n"
    err = run_fail(sandbox, source, limits=replace(LIMITS, timeout_s=1.0))
    assert err.kind == "timeout" and "deadline of 1 s passed" in str(err), err
    assert run_ok(sandbox, ROUND_TRIP, {"question": "q", "n": 1})[0]["n"] == 2


def test_waiting_on_the_host_past_the_deadline_times_out(sandbox):
    source = """
from inferlet import _host
async def main(input):
    return await _host.call_async("sleep", {"ms": 60000})
"""
    api = FakeHost()
    err = run_fail(sandbox, source, api=api, limits=replace(LIMITS, timeout_s=1.0))
    assert err.kind == "timeout" and "deadline of 1 s passed while waiting on the host" in str(err), err
    assert api.resolved == []               # the run ended while the host's 60 s wait was still pending


def test_unbounded_allocation_hits_memory_limit_then_next_run_works(sandbox):
    source = """
async def main(input):
    x = []
    while True:
        x.append(bytearray(10**6))
"""
    err = run_fail(sandbox, source)
    assert err.kind == "memory", err
    assert "main.py" in err.guest_traceback
    assert run_ok(sandbox, ROUND_TRIP, {"question": "q", "n": 2})[0]["n"] == 3


def test_trap_ends_only_that_run(sandbox):
    err = run_fail(sandbox, "import os\nasync def main(input):\n    os._exit(3)\n")
    assert err.kind == "trap", err
    assert run_ok(sandbox, ROUND_TRIP, {"question": "q", "n": 3})[0]["n"] == 4


def test_host_waits_forever_is_a_clear_deadlock_error(sandbox):
    source = "import asyncio\nasync def main(input):\n    await asyncio.get_running_loop().create_future()\n"
    err = run_fail(sandbox, source)
    assert err.kind == "exception" and "deadlock" in err.message


def test_second_load_is_served_from_the_cache(sandbox, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("the runner was rebuilt although its compiled artifact is cached")

    monkeypatch.setattr(build_mod, "componentize", no_build)
    t0 = time.perf_counter()
    again = Sandbox(limits=LIMITS)
    assert again.from_cache and again.artifact.path == sandbox.artifact.path
    assert again.artifact.path.is_file() and again.artifact.path.parent == build_mod.runner_dir()
    print(f"\ncached load: {(time.perf_counter() - t0) * 1000:.1f} ms "
          f"(deserialize {again.deserialize_s * 1000:.1f} ms)")
    assert run_ok(again, ROUND_TRIP, {"question": "q", "n": 9})[0]["n"] == 10


def test_cache_key_follows_the_sources():
    base = build_mod._key(build_mod.EMPTY_BUNDLE)
    assert base == build_mod._key(build_mod.EMPTY_BUNDLE)
    assert base != build_mod._key(build_mod._bundle_module_source({"main": ("main.py", False, "")}, []))


BUNDLE = {
    "main.py": """
import sys
import helper
import hosty
from pkg import sub

async def main(input):
    return {"hsv": helper.to_hsv(input["r"]), "sub": sub.twice(3), "hosty": hosty.VALUE,
            "helper_live_at_import": helper.LIVE_AT_IMPORT, "hosty_live_at_import": hosty.LIVE_AT_IMPORT}
""",
    # colorsys is not in the runner's stdlib subset: the bundle build must bake it in
    "helper.py": """
import colorsys
from inferlet import _host
LIVE_AT_IMPORT = _host._live

def to_hsv(r):
    return list(colorsys.rgb_to_hsv(r, 0.0, 0.0))
""",
    # calls the host at import: cannot be baked in, so it is imported from source at run time
    "hosty.py": """
from inferlet import _host
LIVE_AT_IMPORT = _host._live
VALUE = _host.call("echo", 5)
""",
    "pkg/__init__.py": "BASE = 10\n",
    "pkg/sub.py": "from . import BASE\n\ndef twice(v):\n    return BASE + 2 * v\n",
}


def test_build_bundle_with_helper_modules(tmp_path: Path, sandbox):
    bundle = tmp_path / "bundle"
    for name, text in BUNDLE.items():
        (bundle / name).parent.mkdir(parents=True, exist_ok=True)
        (bundle / name).write_text(text)
    art = build_bundle(bundle)
    print(f"\nbundle: from_cache={art.from_cache} build={art.build_s:.1f}s compile={art.compile_s:.1f}s")
    assert art.modules == ["helper", "hosty", "main", "pkg", "pkg.sub"]
    assert art.missing == []
    assert art.path != sandbox.artifact.path

    bsb = Sandbox(bundle, limits=LIMITS)
    assert bsb.from_cache                                  # build_bundle above cached it
    out, api = run_ok(bsb, "", {"r": 0.5})                 # empty source: the bundled main.py
    assert out == {"hsv": [0.0, 1.0, 0.5], "sub": 16, "hosty": 5,
                   "helper_live_at_import": False,     # imported at build time, in the snapshot
                   "hosty_live_at_import": True}       # imported at launch, from its source
    assert ("echo", 5, 0) in api.calls

    # the plain runner has no colorsys: the bundle component really holds more
    err = run_fail(sandbox, "import colorsys\nasync def main(input):\n    return {}\n")
    assert "No module named 'colorsys'" in err.message


def test_a_bundle_the_runner_can_hold_runs_on_it_from_its_modules(sandbox):
    """No component of its own: the bundle's modules go to the plain runner with the run (and a
    helper that calls the host at import does so at launch)."""
    files = {rel: text for rel, text in BUNDLE.items() if rel != "helper.py"}
    files["main.py"] = files["main.py"].replace("import helper\n", "").replace(
        '"hsv": helper.to_hsv(input["r"]), ', "").replace('"helper_live_at_import": helper.LIVE_AT_IMPORT, ', "")
    assert fits_runner(files) and not fits_runner(BUNDLE)      # colorsys is not in the runner
    out, api = run_ok(sandbox, "", {}, bundle=bundle_modules(files))
    assert out == {"sub": 16, "hosty": 5, "hosty_live_at_import": True}
    assert api.calls == [("echo", 5, 0)]
    # a child's program: source text of its own, with the bundle's modules beside it
    out, _ = run_ok(sandbox, "from pkg import sub\nasync def main(input):\n    return sub.twice(1)\n", {},
                    bundle=bundle_modules(files))
    assert out == 12
    err = run_fail(sandbox, "")                    # no source and no bundle: nothing to run
    assert "no bundled main.py" in err.message


def test_bundles_launched_from_many_threads_at_once_are_read_whole():
    """Runs start on threads of their own, and a bundle's imports are read at its launch
    (`fits_runner`). Four threads at once, with garbage collections running finalizers inside the
    parses (which let another thread in), all get the answer: CPython 3.11's AST constructor
    counts its recursion once per interpreter, and unguarded parses failed with "SystemError: AST
    constructor recursion depth mismatch"."""
    class Cycle:                                   # garbage only the cyclic collector frees
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            sum(range(50))

    errors: list[BaseException] = []

    def launches() -> None:
        try:
            for _ in range(150):
                [Cycle() for _ in range(50)]
                assert not fits_runner(BUNDLE)
        except BaseException as e:                 # noqa: BLE001 (reported below)
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                    # threads take turns as often as they can
    try:
        threads = [threading.Thread(target=launches) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors[:2]


def test_the_component_cache_keeps_the_most_recently_used(tmp_path, monkeypatch):
    import os

    from pie_actors.inferlet.build import cache_dir, prune_cache
    monkeypatch.setenv("PIE_HOME", str(tmp_path))
    folder = cache_dir()
    folder.mkdir(parents=True)
    for age, name in enumerate(["new", "mid", "old", "older"]):
        path = folder / f"runner-{name}.cwasm"
        path.write_bytes(b"x")
        os.utime(path, (1e9 - age * 100, 1e9 - age * 100))
    deleted = prune_cache(keep=2)
    assert sorted(p.name for p in deleted) == ["runner-old.cwasm", "runner-older.cwasm"]
    assert sorted(p.name for p in folder.glob("*.cwasm")) == ["runner-mid.cwasm", "runner-new.cwasm"]
