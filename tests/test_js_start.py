"""A JavaScript run's start: the runner rewrites a main module once, and later runs of the same
source (or the same bundle) are handed the rewritten text by the host, with the same results and
the same errors, at the same lines and columns, as a run that rewrites it."""
from __future__ import annotations

import shutil
import uuid

import pytest

from pie_actors import Program
from pie_actors.inferlet.build import JS_DIR, ensure_js_runner, runner_modules
from pie_actors.inferlet.host import HostApi, HostOpError, InferletError, Sandbox

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (JS_DIR / "node_modules" / ".bin" / "componentize-js").is_file(),
    reason="the JavaScript runner needs node and componentize-js (make setup)")

STOP = [2, 7]


class StopTokens(HostApi):
    """A host that answers chat.stop_tokens only."""

    def call(self, op, args):
        if op != "chat.stop_tokens":
            raise HostOpError(f"{op} is not answered here")
        return STOP


@pytest.fixture(scope="module")
def sandboxes() -> tuple[Sandbox, Sandbox]:
    """The JavaScript runner keeping rewritten main modules, and one that rewrites in every run."""
    return Sandbox(runner=ensure_js_runner), Sandbox(runner=ensure_js_runner, codes_kept=0)


def outcome(sandbox: Sandbox, source: str, input, bundle=None) -> tuple[object, bool]:
    """(main's result, or the error's kind, message and traceback; whether the run was handed
    its main module)."""
    stats = {}
    try:
        result = sandbox.run(source, input, StopTokens(), stats=stats, bundle=bundle)
    except InferletError as e:
        result = (e.kind, e.message, e.guest_traceback)
    return result, stats["main_cached"]


# the first line is where the runner's wrapper goes: a column there is the source's own
SOURCE = """function fixed(x) { return x.n.toFixed(1); }
import { chat } from 'inferlet';
const STOP = chat.stopTokens();
export async function main(input) {
  return [...STOP, fixed(input)];
}
"""


def test_a_main_module_is_rewritten_once_and_its_results_and_errors_stay(sandboxes):
    keeping, rewriting = sandboxes
    source = f"{SOURCE}// {uuid.uuid4()}\n"
    ok, fails = {"n": 3}, {"n": None}
    cached = []
    for input in (ok, ok, fails, ok):
        got, was_cached = outcome(keeping, source, input)
        want, rewritten = outcome(rewriting, source, input)
        assert got == want and not rewritten
        cached.append(was_cached)
    assert cached == [False, True, True, True]
    assert outcome(keeping, source, ok)[0] == [*STOP, "3.0"]
    kind, message, traceback = outcome(keeping, source, fails)[0]
    assert kind == "exception" and message.startswith("TypeError: ") and message.endswith("(at main.js:1:21)")
    assert "fixed@main.js:1:21" in traceback and "main@main.js:5:20" in traceback


def test_a_syntax_error_is_the_same_from_the_handed_over_module(sandboxes):
    keeping, rewriting = sandboxes
    broken = f"// {uuid.uuid4()}\nexport async function main(input) {{\n  return (;\n}}\n"
    first, again, reference = outcome(keeping, broken, {}), outcome(keeping, broken, {}), outcome(rewriting, broken, {})
    assert first == (reference[0], False) and again == (reference[0], True)
    kind, message, _ = reference[0]
    assert kind == "exception" and message.startswith("SyntaxError: ") and message.endswith("(main.js:3:11)")


def test_a_bundles_main_module_is_rewritten_once(sandboxes, tmp_path):
    keeping, rewriting = sandboxes
    (tmp_path / "lib").mkdir()
    (tmp_path / "main.js").write_text(f"// {uuid.uuid4()}\nimport {{ twice }} from './lib/math.js';\n"
                                      "export async function main(input) {\n  return twice(input.x);\n}\n")
    (tmp_path / "lib" / "math.js").write_text("import { chat } from 'inferlet';\n"
                                              "export const twice = (x) => [...chat.stopTokens(), 2 * x];\n")
    modules = runner_modules(Program.load(tmp_path))
    runs = [outcome(keeping, "", {"x": x}, modules) for x in (1, 2)]
    assert runs == [([*STOP, 2], False), ([*STOP, 4], True)]
    assert outcome(rewriting, "", {"x": 2}, modules) == ([*STOP, 4], False)
