"""JavaScript inferlets: the runner component (componentize-js), the `inferlet` SDK for JavaScript,
device programs byte-identical to Python's, the quickstart's tokens, and errors an author can act on."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pie_actors import Program
from pie_actors.inferlet.chat_ops import ChatTokens
from pie_actors.inferlet.build import JS_DIR, ensure_js_runner
from pie_actors.inferlet.host import HostApi, HostOpError, InferletError, Sandbox
from pie_actors.inferlet.run import sandbox_for
from pie_actors.ws_protocol import program_hash, program_of, program_payload

from inferlet_helpers import EXAMPLES, referenced, run, settle

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (JS_DIR / "node_modules" / ".bin" / "componentize-js").is_file(),
    reason="the JavaScript runner needs node and componentize-js (make setup)")

QUICKSTART_JS = EXAMPLES / "js" / "quickstart" / "main.js"
QUESTION = "What is the capital of France?"


def js(source: str) -> Program:
    return Program(source=source, language="javascript")


# ---------------------------------------------------------------------------------------------
# identical device programs

class ProgramRecorder(HostApi):
    """A host that answers only eta.program, keeping the IR text each program sends."""

    def __init__(self) -> None:
        super().__init__()
        self.irs: list[str] = []

    def call(self, op, args):
        if op != "eta.program":
            raise HostOpError(f"{op} is not answered here")
        self.irs.append(args)
        return len(self.irs)


# each sampler as the Python SDK and the JavaScript SDK write it
SAMPLERS = {
    "argmax": ("reduce_argmax(intrinsics.output(0, 'logits'))",
               "reduceArgmax(intrinsics.output(0, 'logits'))"),
    "temperature": ("gumbel_max(intrinsics.output(0, 'logits') / 0.7)",
                    "gumbelMax(intrinsics.output(0, 'logits').div(0.7))"),
    "top-k": ("masked_argmax(intrinsics.output(0, 'logits'), top_k(intrinsics.output(0, 'logits'), 20))",
              "maskedArgmax(intrinsics.output(0, 'logits'), topK(intrinsics.output(0, 'logits'), 20))"),
}


def traced_irs(sandbox: Sandbox, source: str) -> list[str]:
    recorder = ProgramRecorder()
    assert sandbox.run(source, {}, recorder) == "traced"
    return recorder.irs


def test_epilogues_trace_to_the_same_ir_bytes_as_python():
    python = "\n".join(["from inferlet.eta import *", "async def main(input):"]
                       + [f"    ForwardPass().epilogue(lambda: {py})" for py, _ in SAMPLERS.values()]
                       + ["    return 'traced'"])
    javascript = "\n".join(["import * as inferlet from 'inferlet';",
                            "const { ForwardPass, intrinsics } = inferlet;",
                            "const { reduceArgmax, gumbelMax, maskedArgmax, topK } = inferlet;",
                            "export async function main(input) {"]
                           + [f"  new ForwardPass().epilogue(() => {j});" for _, j in SAMPLERS.values()]
                           + ["  return 'traced';", "}"])
    py_irs = traced_irs(sandbox_for(Program(source=python)), python)
    js_irs = traced_irs(sandbox_for(js(javascript)), javascript)
    assert len(py_irs) == len(SAMPLERS)
    assert js_irs == py_irs
    assert py_irs[0] == '{"ops":[["output",[0,"logits"]],["reduce_argmax",[{"t":0}]]],"outputs":[1]}'


# ---------------------------------------------------------------------------------------------
# the quickstart

def test_program_load_reads_a_js_file():
    program = Program.load(QUICKSTART_JS)
    assert program.language == "javascript" and program.bundle is None
    assert program.source == QUICKSTART_JS.read_text()
    assert Program.load(EXAMPLES / "quickstart" / "main.py").language == "python"
    # an upload to pie serve (pie run without --local) carries the language, and so does its hash
    payload = program_payload(program)
    assert program_of(payload) == program and payload["language"] == "javascript"
    assert program_hash(program) != program_hash(Program(source=program.source))


def test_quickstart_in_javascript_gives_the_python_quickstart_tokens(runtime):
    start = referenced(runtime)
    sent: list[str] = []
    out = run(runtime, Program.load(QUICKSTART_JS), {"question": QUESTION}, on_send=sent.append)
    want = run(runtime, Program.load(EXAMPLES / "quickstart" / "main.py"), {"question": QUESTION})
    assert out == want and "Paris" in out["text"]
    assert "".join(sent) == out["text"] and len(sent) > 1
    # and both are the engine's own greedy reply
    engine = runtime.engine
    chat = ChatTokens(engine.tokenizer)
    prompt = chat.system("You are a concise assistant.") + chat.user(QUESTION) + chat.cue_without_thinking()
    n = len(engine.tokenizer.encode(out["text"]))
    assert engine.tokenizer.decode(engine.generate([prompt], n, ignore_eos=True)[0]) == out["text"]
    settle(runtime, start)


# ---------------------------------------------------------------------------------------------
# errors

THROWS = """import { WorkingSet, ForwardPass, Pipeline, StateGeometry, intrinsics, reduceArgmax, chat } from 'inferlet';

async function step(ws, pipe) {
  const fwd = new ForwardPass().embed(chat.user('hi')).state([ws], StateGeometry.folding());
  const token = fwd.epilogue(() => reduceArgmax(intrinsics.output(0, 'logits')));
  pipe.submit(fwd);
  return await token;
}

export async function main(input) {
  const ws = new WorkingSet();
  await step(ws, new Pipeline());
  throw new Error(`no luck with ${input.what}`);
}
"""


def test_a_thrown_error_fails_the_run_with_its_message_and_line(runtime):
    start = referenced(runtime)
    with pytest.raises(InferletError) as err:
        run(runtime, js(THROWS), {"what": "tokens"})
    assert err.value.kind == "exception"
    assert err.value.message == "Error: no luck with tokens (at main.js:13:9)"
    assert "main@main.js:13:9" in err.value.guest_traceback
    settle(runtime, start)


@pytest.mark.parametrize("source, where, what", [
    ("import { model } from 'inferlet';\nexport async function main(input) {\n  return model.encode(;\n}\n",
     "main.js:3:23", "SyntaxError: expected expression, got ';'"),
    ("let x = ;\nexport async function main(input) { return 1; }\n", "main.js:1:9",
     "SyntaxError: expected expression, got ';'"),
])
def test_a_syntax_error_names_its_line_and_column(runtime, source, where, what):
    start = referenced(runtime)
    with pytest.raises(InferletError) as err:
        run(runtime, js(source), {})
    assert err.value.kind == "exception"
    assert err.value.message.startswith(what) and f"({where})" in err.value.message
    settle(runtime, start)


def test_an_unknown_import_names_the_module(runtime):
    source = "import { x } from 'left-pad';\nexport async function main(input) { return x; }\n"
    with pytest.raises(InferletError, match='unknown import: module "left-pad"'):
        run(runtime, js(source), {})


def test_the_runner_is_built_once_and_cached():
    first, again = ensure_js_runner(), ensure_js_runner()
    assert again.from_cache and again.path == first.path and Path(first.path).stat().st_size > 0
