"""Errors a JavaScript author can act on: in a bundle, a syntax error, a thrown Error and an unknown
import name the module's file, line and column; and the sandbox's limits (deadline, memory, a host
call's size) end a JavaScript run with the typed errors they give a Python one, while a neighbour
running beside it gets the tokens it gets alone and every KV page comes back.

The abuse harness is tests/test_abuse.py's: its dummy-model runtime with small limits, its Python
neighbour, and its checks."""
from __future__ import annotations

import shutil
import textwrap

import pytest

from pie_actors import InferletError, Program
from pie_actors.inferlet.build import JS_DIR

from inferlet_helpers import run
from test_abuse import BOMB_TIMEOUT, NEIGHBOUR, alone, assert_pages_back, failure, next_message, runtime  # noqa: F401

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (JS_DIR / "node_modules" / ".bin" / "componentize-js").is_file(),
    reason="the JavaScript runner needs node and componentize-js (make setup)")


# ---------------------------------------------------------------------------------------------
# errors in a bundle's modules

def bundle(folder, lib: str) -> Program:
    folder.mkdir()
    (folder / "main.js").write_text("import { twice } from './lib/math.js';\n\n"
                                    "export async function main(input) {\n  return twice(input.x);\n}\n")
    (folder / "lib").mkdir()
    (folder / "lib" / "math.js").write_text(lib)
    return Program.load(folder)


@pytest.mark.parametrize("lib, message, where", [
    ("export function twice(x) {\n  if (x > 1) throw new RangeError(`too big: ${x}`);\n  return 2 * x;\n}\n",
     "RangeError: too big: 5", "lib/math.js:2:20"),
    ("export function twice(x) {\n  return 2 * * x;\n}\n", "SyntaxError: expected expression, got '*'", "lib/math.js:2:14"),
    ("import { pad } from 'left-pad';\nexport const twice = (x) => pad(x);\n",
     'Error: unknown import: module "left-pad" in lib/math.js', "lib/math.js:1:"),
], ids=["thrown", "syntax", "unknown_import"])
def test_an_error_in_a_bundle_module_names_its_file_line_and_column(runtime, tmp_path, lib, message, where):
    with pytest.raises(InferletError) as err:
        run(runtime, bundle(tmp_path / "b", lib), {"x": 5})
    assert err.value.kind == "exception"
    assert err.value.message.startswith(message) and where in err.value.message, err.value.message
    assert_pages_back(runtime)


def test_a_stack_names_each_module_of_the_bundle(runtime, tmp_path):
    lib = "export function twice(x) {\n  return check(x) * 2;\n}\nfunction check(x) {\n  throw new Error('no');\n}\n"
    with pytest.raises(InferletError) as err:
        run(runtime, bundle(tmp_path / "b", lib), {"x": 1})
    frames = err.value.guest_traceback.splitlines()
    assert frames[0] == "Error: no"
    assert [f.strip() for f in frames[1:]] == ["at check@lib/math.js:5:9", "at twice@lib/math.js:2:10",
                                               "at main@main.js:4:10"]


# ---------------------------------------------------------------------------------------------
# limits, beside a neighbour

ABUSER = """import { model, session } from 'inferlet';

export async function main(input) {
  session.send('ready');
  await session.receive();
  session.send('going');
{bomb}
}
"""


def abuse(runtime, bomb: str, timeout: float | None = None):
    """test_abuse.abuse with a JavaScript abuser: `bomb` goes off while the Python neighbour is
    halfway through its decode. The neighbour's tokens, and the abuser's process."""
    source = ABUSER.replace("{bomb}", textwrap.indent(textwrap.dedent(bomb), "  "))
    abuser = runtime.launch(Program(source=source, language="javascript"), timeout=timeout)
    assert next_message(abuser) == "ready"
    neighbour = runtime.launch(NEIGHBOUR)
    assert next_message(neighbour) == "halfway"
    abuser.send("go")
    neighbour.send("on")
    return neighbour.result(timeout=60), abuser


@pytest.mark.parametrize("bomb, timeout, kind, says", [
    ("for (;;) {}\n", BOMB_TIMEOUT, "timeout", "deadline of 3 s passed"),
    ("const x = [];\nfor (;;) x.push(new Uint8Array(1 << 20).fill(1));\n", BOMB_TIMEOUT, "memory",
     "the inferlet ran out of memory"),
    ("for (;;) model.encode('spin');\n", BOMB_TIMEOUT, "timeout", "deadline of 3 s passed"),
    ("session.send('x'.repeat(2 << 20));\n", None, "limit", "limits.message_mb"),
    ("session.sendFile(new Uint8Array(1 << 20));\n", None, "exception", "limits.message_mb"),
    ("const down = (n) => down(n + 1) + 1;\ndown(0);\n", None, "exception", "InternalError: too much recursion"),
], ids=["infinite_loop", "memory_grow_bomb", "host_call_spin", "send", "send_file", "recursion"])
def test_a_js_bomb_ends_its_own_run_only(runtime, alone, bomb, timeout, kind, says):
    """As tests/test_abuse.py's bombs: the same kinds, and for the limits the same messages."""
    tokens, abuser = abuse(runtime, bomb, timeout=timeout)
    assert tokens == alone
    error = failure(abuser)
    assert error.kind == kind and says in error.message, error
    assert_pages_back(runtime)


def test_an_import_over_several_lines_keeps_the_lines_where_they_were(runtime):
    source = ("import {\n  model,\n  chat as c,\n} from 'inferlet';\n\nexport async function main(input) {\n"
              "  if (c.stopTokens().length && model.encode('a').length) throw new Error('line 7');\n}\n")
    with pytest.raises(InferletError, match=r"Error: line 7 \(at main.js:7:\d+\)"):
        run(runtime, Program(source=source, language="javascript"), {})


def test_a_program_that_waits_on_nothing_the_host_completes_is_told_so(runtime):
    """A deadlock names itself, and only the program's frames (none of the runner's)."""
    source = "export async function main(input) {\n  await new Promise(() => {});\n}\n"
    with pytest.raises(InferletError) as err:
        run(runtime, Program(source=source, language="javascript"), {})
    assert err.value.message == ("Error: deadlock: every task of the inferlet is waiting, and not on anything "
                                 "the host will complete")
    assert err.value.guest_traceback == err.value.message


def test_a_host_error_names_its_op_once_as_in_python(runtime):
    """A refused argument (the host's check names the op) and a refusal of the op's own."""
    source = ("import { model, WorkingSet, HostError } from 'inferlet';\nexport async function main(input) {\n"
              "  const said = [];\n  for (const f of [() => model.decode(['x']), () => WorkingSet.open('nothing saved')]) {\n"
              "    try { f(); } catch (e) { said.push(e instanceof HostError ? e.message : 'not a HostError'); }\n"
              "  }\n  return said;\n}\n")
    python = ("from inferlet import model, HostError\nfrom inferlet.eta import WorkingSet\nasync def main(input):\n"
              "    said = []\n    for f in (lambda: WorkingSet.open('nothing saved'),):\n"
              "        try:\n            f()\n        except HostError as e:\n            said.append(str(e))\n"
              "    return said\n")
    said = run(runtime, Program(source=source, language="javascript"), {})
    assert said[1:] == run(runtime, Program(source=python), {})
    assert said[0].startswith("model.decode: ") and not said[0].startswith("model.decode: model.decode: ")
    assert said[1].startswith("ws.open: ") and not said[1].startswith("ws.open: ws.open: ")
