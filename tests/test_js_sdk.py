"""The JavaScript SDK's surface against the Python SDK's: device programs traced in JavaScript are
the same IR bytes as Python's (the documents' samplers, and Python's float text), and programs that
use channels, run-ahead, grammars, tools, reasoning, sessions, files, runtime and http give the
same results as their Python twins."""
from __future__ import annotations

import dataclasses
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pie_actors import Program
from pie_actors.inferlet.build import JS_DIR
from pie_actors.inferlet.host import HostApi, HostOpError
from pie_actors.inferlet.run import sandbox_for

from inferlet_helpers import referenced, run, settle

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (JS_DIR / "node_modules" / ".bin" / "componentize-js").is_file(),
    reason="the JavaScript runner needs node and componentize-js (make setup)")


def js(source: str) -> Program:
    return Program(source=source, language="javascript")


# ---------------------------------------------------------------------------------------------
# identical device programs

class ProgramRecorder(HostApi):
    """A host that answers only what tracing needs: eta.program (keeping each IR text) and
    chan.create (a channel a traced function puts into or takes from)."""

    def __init__(self) -> None:
        super().__init__()
        self.irs: list[str] = []
        self.channels = 0

    def call(self, op, args):
        if op == "eta.program":
            self.irs.append(args)
            return len(self.irs)
        if op == "chan.create":
            self.channels += 1
            return self.channels
        raise HostOpError(f"{op} is not answered here")


def traced(program: Program) -> list[str]:
    recorder = ProgramRecorder()
    assert sandbox_for(program).run(program.source, {"a": 1, "t": 0.7}, recorder) == "traced"
    return recorder.irs


# The documents' samplers, each as the Python SDK and the JavaScript SDK write it: an epilogue
# over `logits` (the model output), `vocab` (49152), `seed` and `mask` (channels).
SAMPLERS = {
    "argmax": ("reduce_argmax(logits)", "reduceArgmax(logits)"),
    "temperature": ("gumbel_max(logits / float(input['t']), seed.take())",
                    "gumbelMax(logits.div(float(input.t)), seed.take())"),
    "temperature 1.0": ("gumbel_max(logits / float(input['a']), seed.take())",
                        "gumbelMax(logits.div(float(input.a)), seed.take())"),
    "top-k": ("gumbel_max(top_k(logits / 0.8, 40), seed.take())",
              "gumbelMax(topK(logits.div(0.8), 40), seed.take())"),
    "top-p": ("gumbel_max(mask_apply(logits / 0.8, cummass_le(softmax(logits / 0.8), 0.95)), seed.take())",
              "gumbelMax(maskApply(logits.div(0.8), cummassLe(softmax(logits.div(0.8)), 0.95)), seed.take())"),
    "top-a": ("top_a(logits, vocab, float(input['a']), seed.take())",
              "topA(logits, vocab, float(input.a), seed.take())"),
    "grammar mask": ("masked_argmax(logits, mask.take())", "maskedArgmax(logits, mask.take())"),
    "floats": ("broadcast([1e-05, 1.5e-07, 0.0001, 1e16, 1e15, 2.5, -0.3, 1/3, 5e-324, float('-inf'), -0.0, 3], [12])",
               "broadcast([1e-5, 1.5e-7, 0.0001, float(1e16), float(1e15), 2.5, -0.3, 1/3, 5e-324, -Infinity, float(-0), 3], [12])"),
}

PY_TRACER = """from inferlet.eta import *
from inferlet.eta import top_k, mask_apply, cummass_le, softmax, gumbel_max, reduce_argmax, masked_argmax

def top_a(logits, vocab, a, rng):
    probs = softmax(logits)
    p_max = reduce_max(probs)
    keep = ge(probs, broadcast(a * p_max * p_max, [vocab]))
    return gumbel_max(select(keep, logits, broadcast(float("-inf"), [vocab])), rng)

async def main(input):
    vocab, seed, mask = 49152, Channel([1], dtype.i64), Channel([49152], dtype.bool)
"""

JS_TRACER = """import * as inferlet from 'inferlet';
const { ForwardPass, Channel, dtype, float, intrinsics, broadcast, ge, gumbelMax, mul, reduceMax, select,
        softmax, reduceArgmax, topK, maskApply, cummassLe, maskedArgmax } = inferlet;

function topA(logits, vocab, a, rng) {
  const probs = softmax(logits);
  const pMax = reduceMax(probs);
  const keep = ge(probs, broadcast(mul(a, pMax).mul(pMax), [vocab]));
  return gumbelMax(select(keep, logits, broadcast(float(-Infinity), [vocab])), rng);
}

export async function main(input) {
  const [vocab, seed, mask] = [49152, new Channel([1], dtype.i64), new Channel([49152], dtype.bool)];
"""


def test_samplers_trace_to_the_python_ir_bytes():
    python = PY_TRACER + "".join(
        f"    ForwardPass().epilogue(lambda: (lambda logits: {py})(intrinsics.output(0, 'logits')))\n"
        for py, _ in SAMPLERS.values()) + "    return 'traced'\n"
    javascript = JS_TRACER + "".join(
        f"  new ForwardPass().epilogue(() => ((logits) => {j})(intrinsics.output(0, 'logits')));\n"
        for _, j in SAMPLERS.values()) + "  return 'traced';\n}\n"
    py_irs, js_irs = traced(Program(source=python)), traced(js(javascript))
    assert len(py_irs) == len(SAMPLERS)
    for name, py_ir, js_ir in zip(SAMPLERS, py_irs, js_irs):
        assert js_ir == py_ir, name
    floats = py_irs[-1]
    assert '[1e-05,1.5e-07,0.0001,1e+16,1000000000000000.0,2.5,-0.3,0.3333333333333333,5e-324,-Infinity,-0.0,3]' in floats
    assert '["div",[{"t":0},1.0]]' in py_irs[2]          # input a = 1, a float in both


def test_the_temperature_sampler_of_the_run_ahead_example_traces_alike():
    """examples/temperature's epilogue (channels put and taken on the device) in both SDKs."""
    python = """from inferlet.eta import *
async def main(input):
    rng, token_in, token_out = Channel.from_([5], dtype.i64), Channel([1], dtype.i32), Channel([1], dtype.i32)
    def sample():
        step_seed = rng.take()
        rng.put(step_seed + 1)
        token = reshape(gumbel_max(intrinsics.output(0, "logits") / input["t"], step_seed), [1])
        token_in.put(token)
        token_out.put(token)
    ForwardPass().epilogue(sample)
    return "traced"
"""
    javascript = """import { Channel, ForwardPass, dtype, gumbelMax, intrinsics, reshape } from 'inferlet';
export async function main(input) {
  const [rng, tokenIn, tokenOut] = [Channel.from([5], dtype.i64), new Channel([1], dtype.i32), new Channel([1], dtype.i32)];
  new ForwardPass().epilogue(() => {
    const stepSeed = rng.take();
    rng.put(stepSeed.add(1));
    const token = reshape(gumbelMax(intrinsics.output(0, 'logits').div(input.t), stepSeed), [1]);
    tokenIn.put(token);
    tokenOut.put(token);
  });
  return 'traced';
}
"""
    assert traced(js(javascript)) == traced(Program(source=python))


class TextRecorder(HostApi):
    """A host that keeps what model.encode is asked and what is sent, answering encode with
    the text's code points."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def call(self, op, args):
        if op != "model.encode":
            raise HostOpError(f"{op} is not answered here")
        self.seen.append(args)
        return [ord(c) for c in args]

    def send(self, message: str) -> None:
        self.seen.append(message)


def test_text_of_every_utf8_length_reaches_the_host_as_from_python():
    """Strings cross to the host in the runner's bindings, encoded natively: ASCII, 2-, 3- and
    4-byte characters, short and long, arrive as the Python SDK sends them."""
    texts = ["", "a", "é" * 3, "漢字", "😀a😀", "x" * 5000 + "ü€😀" * 700]
    python = ("from inferlet import model, session\nasync def main(input):\n"
              "    for text in input['texts']:\n        session.send(text)\n        model.encode(text)\n"
              "    return {'texts': input['texts'], 'codes': [model.encode(text) for text in input['texts']]}\n")
    javascript = ("import { model, session } from 'inferlet';\nexport async function main(input) {\n"
                  "  for (const text of input.texts) {\n    session.send(text);\n    model.encode(text);\n  }\n"
                  "  return { texts: input.texts, codes: input.texts.map((text) => model.encode(text)) };\n}\n")
    runs = {}
    for name, program in (("python", Program(source=python)), ("javascript", js(javascript))):
        recorder = TextRecorder()
        result = sandbox_for(program).run(program.source, {"texts": texts}, recorder)
        runs[name] = (result, recorder.seen)
    assert runs["javascript"] == runs["python"]
    result, seen = runs["python"]
    assert result["texts"] == texts and result["codes"][-1] == [ord(c) for c in texts[-1]]
    assert seen[:4] == ["", "", "a", "a"] and seen[-1] == texts[-1]


def test_an_epilogue_in_a_loop_is_a_new_program_only_when_its_trace_changes():
    """The same arrow traced at every pass asks the host once; when a value it closes over
    changes, the new IR is asked for, and a float stays apart from an int, -0.0 from 0.0, NaN
    and the infinities from each other (Python's IR for each value, each its own lambda)."""
    values = ["0.5", "1", "1.0", "float('nan')", "float('inf')", "float('-inf')", "-0.0", "0.0"]
    python = "from inferlet.eta import *\nasync def main(input):\n" + "".join(
        f"    ForwardPass().epilogue(lambda: gumbel_max(intrinsics.output(0, 'logits') / {v}, 3))\n"
        for v in values) + "    return 'traced'\n"
    javascript = """import { ForwardPass, float, gumbelMax, intrinsics } from 'inferlet';
export async function main(input) {
  for (const t of [0.5, 0.5, 1, 1, float(1), float(1), NaN, NaN, Infinity, -Infinity, -Infinity,
                   float(-0), float(0), float(-0)]) {
    new ForwardPass().epilogue(() => gumbelMax(intrinsics.output(0, 'logits').div(t), 3));
  }
  return 'traced';
}
"""
    py_irs = traced(Program(source=python))
    assert len(set(py_irs)) == len(values)
    assert traced(js(javascript)) == py_irs
    # one Python lambda in a loop: its trace is reused only for a value of the same type and bits
    in_a_loop = ("from inferlet.eta import *\nasync def main(input):\n    for t in [" + ", ".join(values) + "]:\n"
                 "        ForwardPass().epilogue(lambda: gumbel_max(intrinsics.output(0, 'logits') / t, 3))\n"
                 "    return 'traced'\n")
    assert traced(Program(source=in_a_loop)) == py_irs


# ---------------------------------------------------------------------------------------------
# the rest of the surface, against the engine

SURFACE_PY = """import json
from inferlet import chat, model, session, runtime, tools, reasoning
from inferlet.eta import *
from inferlet.grammar import Grammar, Matcher
from inferlet.mask import unpack_mask

async def main(input):
    out = {"name": runtime.name(), "file": session.file("notes").decode()}
    m = Matcher(Grammar.from_regex("(yes|no)"))
    yes = model.encode("yes")
    words = m.mask()
    out["allowed"] = sum(unpack_mask(words, model.output_vocab_size()))
    fork = m.fork()
    out["accept"] = [m.accept_tokens(yes), fork.accept_tokens(model.encode("maybe")), m.is_terminated()]
    m.rollback(len(yes))
    out["after_rollback"] = m.is_terminated()
    m.reset()
    specs = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    out["equip"] = tools.equip(specs, "Use tools.")
    out["answer"] = tools.answer("weather", {"sunny": True})
    decoder = tools.Decoder()
    call = model.encode('<tool_call>\\n{"name": "weather", "arguments": {"city": "Paris"}}\\n</tool_call>')
    events = [decoder.feed([t]) for t in call] + [decoder.finish()]
    out["tool_events"] = [type(e).__name__ + (":" + e.call.name + json.dumps(e.call.arguments) if hasattr(e, "call") else "")
                          for e in events if type(e).__name__ != "Idle"]
    think = reasoning.Decoder.for_cue(chat.cue())
    out["reasoning"] = [type(e).__name__ for e in (think.feed(model.encode(" hello")), think.feed([]))]

    # run-ahead: a greedy loop fed on the device, read with take_scalar
    prompt = chat.prefix() + model.encode("The sky is")
    token_in, token_out = Channel([1], dtype.i32), Channel([1], dtype.i32).capacity(model.channel_capacity())
    def sample():
        token = reshape(reduce_argmax(intrinsics.output(0, "logits")), [1])
        token_in.put(token)
        token_out.put(token)
    ws, pipe = WorkingSet(), Pipeline()
    first = ForwardPass().embed(prompt).state([ws], StateGeometry.folding())
    first.epilogue(sample)
    pipe.submit(first)
    tokens = [await token_out.take_scalar()]
    step = ForwardPass().embed(token_in, Channel.from_([0, 1], dtype.u32)).state([ws], StateGeometry.folding())
    step.epilogue(sample)
    async def on_token():
        tokens.append(await token_out.take_scalar())
        return len(tokens) < 6
    out["kept"] = await pipe.run_ahead(step, 10, on_token)
    out["tokens"] = tokens
    out["folded"] = ws.folded()
    child = ws.fork()
    out["child_folded"] = child.folded()
    pipe.close()

    session.send_file(b"\\x00\\x01bytes")
    got = await session.receive_file()
    out["file_back"] = list(got)
    sender, message = await session.receive_from()
    out["message"] = [sender, message]
    return out
"""

SURFACE_JS = """import { chat, model, session, runtime, tools, reasoning, Grammar, Matcher, unpackMask, Channel, ForwardPass,
         Pipeline, StateGeometry, WorkingSet, dtype, intrinsics, reduceArgmax, reshape } from 'inferlet';

export async function main(input) {
  const out = { name: runtime.name(), file: new TextDecoder().decode(session.file('notes')) };
  const m = new Matcher(Grammar.fromRegex('(yes|no)'));
  const yes = model.encode('yes');
  const words = m.mask();
  out.allowed = unpackMask(words, model.outputVocabSize()).filter(Boolean).length;
  const fork = m.fork();
  out.accept = [m.acceptTokens(yes), fork.acceptTokens(model.encode('maybe')), m.isTerminated()];
  m.rollback(yes.length);
  out.after_rollback = m.isTerminated();
  m.reset();
  const specs = [{ type: 'function', function: { name: 'weather', description: 'Weather of a city',
                   parameters: { type: 'object', properties: { city: { type: 'string' } } } } }];
  out.equip = tools.equip(specs, 'Use tools.');
  out.answer = tools.answer('weather', { sunny: true });
  const decoder = new tools.Decoder();
  const call = model.encode('<tool_call>\\n{"name": "weather", "arguments": {"city": "Paris"}}\\n</tool_call>');
  const events = [...call.map((t) => decoder.feed([t])), decoder.finish()];
  out.tool_events = events.filter((e) => !(e instanceof tools.Event.Idle)).map((e) =>
    e instanceof tools.Event.Call ? `Call:${e.call.name}${JSON.stringify(e.call.arguments).replace(':', ': ')}`
                                  : String(e).slice(8, -1));
  const think = reasoning.Decoder.forCue(chat.cue());
  out.reasoning = [think.feed(model.encode(' hello')), think.feed([])].map((e) => String(e).slice(8, -1));

  const prompt = [...chat.prefix(), ...model.encode('The sky is')];
  const [tokenIn, tokenOut] = [new Channel([1], dtype.i32), new Channel([1], dtype.i32).capacity(model.channelCapacity())];
  const sample = () => {
    const token = reshape(reduceArgmax(intrinsics.output(0, 'logits')), [1]);
    tokenIn.put(token);
    tokenOut.put(token);
  };
  const [ws, pipe] = [new WorkingSet(), new Pipeline()];
  const first = new ForwardPass().embed(prompt).state([ws], StateGeometry.folding());
  first.epilogue(sample);
  pipe.submit(first);
  const tokens = [await tokenOut.takeScalar()];
  const step = new ForwardPass().embed(tokenIn, Channel.from([0, 1], dtype.u32)).state([ws], StateGeometry.folding());
  step.epilogue(sample);
  out.kept = await pipe.runAhead(step, 10, async () => {
    tokens.push(await tokenOut.takeScalar());
    return tokens.length < 6;
  });
  out.tokens = tokens;
  out.folded = ws.folded();
  out.child_folded = ws.fork().folded();
  pipe.close();

  session.sendFile(new Uint8Array([0, 1, ...new TextEncoder().encode('bytes')]));
  out.file_back = [...await session.receiveFile()];
  const [sender, message] = await session.receiveFrom();
  out.message = [sender, message];
  return out;
}
"""


def surface(runtime, program: Program, name: str) -> tuple[dict, list[bytes]]:
    files: list[bytes] = []
    process = runtime.launch(program, {}, name=name, files={"notes": "café".encode()})
    process.send_file(b"back")
    process.send({"hi": 1})
    for event in process.events(timeout=120):
        data = getattr(event, "data", None)
        if isinstance(data, bytes):
            files.append(data)
    return process.result(), files


def test_the_sdk_surface_gives_the_python_sdk_results(runtime):
    start = referenced(runtime)
    out, files = surface(runtime, js(SURFACE_JS), "surface")
    want, want_files = surface(runtime, Program(source=SURFACE_PY), "surface")
    assert out == want and files == want_files == [b"\x00\x01bytes"]
    assert out["name"] == "surface" and out["file"] == "café" and out["file_back"] == list(b"back")
    assert out["accept"] == [True, False, True] and not out["after_rollback"] and out["allowed"] >= 2
    assert out["tool_events"] == ["Start", 'Call:weather{"city": "Paris"}'], out["tool_events"]
    assert len(out["tokens"]) == 6 and out["message"] == [None, {"hi": 1}]
    settle(runtime, start)


class _Hello(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        self.send_response(201)
        self.send_header("content-type", "application/json")
        self.send_header("x-twice", "1")
        self.send_header("x-twice", "2")
        self.end_headers()
        self.wfile.write(b'{"echo": ' + body + b"}")

    def log_message(self, *args):
        pass


def test_http_fetch_answers_as_in_python(runtime):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/hello"
    python = """from inferlet import http
async def main(input):
    r = await http.fetch(input["url"], method="POST", headers={"content-type": "application/json"}, body='"hi"')
    try:
        await http.fetch("http://example.invalid/")
    except http.HttpError as e:
        refused = e.kind
    return {"status": r.status, "ok": r.ok, "json": r.json(), "list": r.header_list[-2:], "type": r.headers["content-type"],
            "refused": refused}
"""
    javascript = """import { http, HttpError } from 'inferlet';
export async function main(input) {
  const r = await http.fetch(input.url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '"hi"' });
  let refused;
  try {
    await http.fetch('http://example.invalid/');
  } catch (e) {
    if (!(e instanceof HttpError)) throw e;
    refused = e.kind;
  }
  return { status: r.status, ok: r.ok, json: r.json(), list: r.headerList.slice(-2), type: r.headers['content-type'],
           refused };
}
"""
    limits = dataclasses.replace(runtime.config.limits, allow_hosts=("127.0.0.1",))
    try:
        out = runtime.launch(js(javascript), {"url": url}, limits=limits).result(60)
        want = runtime.launch(python, {"url": url}, limits=limits).result(60)
    finally:
        server.shutdown()
    assert out == want
    assert out["status"] == 201 and out["json"] == {"echo": "hi"} and out["refused"] == "refused"
    assert out["list"] == [["x-twice", "1"], ["x-twice", "2"]]


STATE_PY = """from inferlet import chat, model
from inferlet.eta import *

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    prompt = chat.prefix() + model.encode("The capital of France is")
    fwd = ForwardPass().embed(prompt).state([ws], StateGeometry.folding()).readout([len(prompt) - 2, len(prompt) - 1])
    rows = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    adapted = ForwardPass().embed(prompt).state([WorkingSet()], StateGeometry.folding())
    adapted.adapter("o", lambda x, y: y * 1.0)
    adapted_token = adapted.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(adapted)
    out = {"rows": await rows, "adapted": await adapted_token, "saved_tokens": ws.save("js-sdk-state")}
    out["saved"] = [s["name"] for s in WorkingSet.saved()]
    opened = WorkingSet.open("js-sdk-state")
    out["restored"], out["opened_folded"] = opened.restored, opened.folded()
    pipe.park()
    out["next"] = [t async for t in generate(opened, pipe, [out["rows"][-1]], 4)]
    WorkingSet.delete_saved("js-sdk-state")
    out["after_delete"] = WorkingSet.saved()
    chan = Channel([2], dtype.i32).capacity(2)
    chan.put([5, 6])
    out["host_take"] = chan.take()
    out["cached"] = ws.cached_tokens()
    pipe.close()
    return out
"""

STATE_JS = """import { chat, model, ForwardPass, Pipeline, StateGeometry, WorkingSet, Channel, dtype, intrinsics,
         reduceArgmax, float, generate } from 'inferlet';

export async function main(input) {
  const [ws, pipe] = [new WorkingSet(), new Pipeline()];
  const prompt = [...chat.prefix(), ...model.encode('The capital of France is')];
  const fwd = new ForwardPass().embed(prompt).state([ws], StateGeometry.folding()).readout([prompt.length - 2, prompt.length - 1]);
  const rows = fwd.epilogue(() => reduceArgmax(intrinsics.output(0, 'logits')));
  pipe.submit(fwd);
  const adapted = new ForwardPass().embed(prompt).state([new WorkingSet()], StateGeometry.folding());
  adapted.adapter('o', (x, y) => y.mul(float(1)));
  const adaptedToken = adapted.epilogue(() => reduceArgmax(intrinsics.output(0, 'logits')));
  pipe.submit(adapted);
  const out = { rows: await rows, adapted: await adaptedToken, saved_tokens: ws.save('js-sdk-state') };
  out.saved = WorkingSet.saved().map((s) => s.name);
  const opened = WorkingSet.open('js-sdk-state');
  [out.restored, out.opened_folded] = [opened.restored, opened.folded()];
  pipe.park();
  out.next = [];
  for await (const t of generate(opened, pipe, [out.rows[out.rows.length - 1]], 4)) out.next.push(t);
  WorkingSet.deleteSaved('js-sdk-state');
  out.after_delete = WorkingSet.saved();
  const chan = new Channel([2], dtype.i32).capacity(2);
  chan.put([5, 6]);
  out.host_take = chan.take();
  out.cached = ws.cachedTokens();
  pipe.close();
  return out;
}
"""


def test_working_sets_adapters_readout_and_host_channels_as_in_python(runtime):
    start = referenced(runtime)
    out = run(runtime, js(STATE_JS), {})
    want = run(runtime, Program(source=STATE_PY), {})
    assert out == want
    assert len(out["rows"]) == 2 and out["adapted"] == out["rows"][-1] and out["saved"] == ["js-sdk-state"] and out["after_delete"] == []
    assert out["restored"] == "kept" and out["opened_folded"] == out["saved_tokens"] and len(out["next"]) == 4
    assert out["host_take"] == [5, 6]
    settle(runtime, start)
