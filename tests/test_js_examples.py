"""The JavaScript examples (examples/js) against their Python originals: the same tokens (greedy, or
the same seed), a bundle whose modules import each other, runtime.spawn of a .js module, and
messages between JavaScript processes and between a Python and a JavaScript one."""
from __future__ import annotations

import json
import shutil

import pytest

from pie_actors import Done, Program
from pie_actors.inferlet.build import JS_DIR

from inferlet_helpers import EXAMPLES, pages_return, referenced, run, settle

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (JS_DIR / "node_modules" / ".bin" / "componentize-js").is_file(),
    reason="the JavaScript runner needs node and componentize-js (make setup)")

JS = EXAMPLES / "js"


@pytest.mark.parametrize("a, seed", [(0.2, 0), (0.2, 7), (1, 3)])
def test_top_a_gives_the_python_original_tokens_for_a_seed(runtime, a, seed):
    """a = 1 is a whole number: the JavaScript program marks it a float, as Python's float(1) is."""
    start = referenced(runtime)
    given = {"prompt": "Once upon a time", "max_tokens": 12, "a": a, "seed": seed}
    out = run(runtime, Program.load(JS / "top_a" / "main.js"), given)
    want = run(runtime, Program.load(EXAMPLES / "top_a" / "main.py"), given)
    assert out == want and len(out["tokens"]) == 12
    settle(runtime, start)


def test_top_a_samples_other_tokens_with_another_seed(runtime):
    outs = [run(runtime, Program.load(JS / "top_a" / "main.js"), {"max_tokens": 12, "a": 0.05, "seed": s})
            for s in (1, 2)]
    assert outs[0]["tokens"] != outs[1]["tokens"]


def test_constrained_json_gives_the_python_original_tokens(runtime):
    start = referenced(runtime)
    out = run(runtime, Program.load(JS / "constrained_json" / "main.js"), {"max_tokens": 64})
    want = run(runtime, Program.load(EXAMPLES / "constrained_json" / "main.py"), {"max_tokens": 64})
    assert out == want
    assert out["complete"] and set(out["value"]) == {"name", "age", "city"}
    bad = run(runtime, Program.load(JS / "constrained_json" / "main.js"), {"schema": {"type": "nope"}})
    assert bad == run(runtime, Program.load(EXAMPLES / "constrained_json" / "main.py"), {"schema": {"type": "nope"}})
    assert "error" in bad
    settle(runtime, start)


def test_interactive_chat_gives_the_python_original_turns(runtime):
    start = referenced(runtime)
    messages = ["What is the capital of France?", {"content": "And of Italy?"}, "/bye"]
    sent_js: list[str] = []
    out = run(runtime, Program.load(JS / "interactive_chat" / "main.js"), {"max_tokens": 24}, messages=messages,
              on_send=sent_js.append)
    sent_py: list[str] = []
    want = run(runtime, Program.load(EXAMPLES / "interactive_chat" / "main.py"), {"max_tokens": 24},
               messages=messages, on_send=sent_py.append)
    # cached_tokens aside: the second run finds the first one's pages in the prefix cache
    strip = lambda turns: [{k: v for k, v in t.items() if k != "cached_tokens"} for t in turns]
    assert strip(out["turns"]) == strip(want["turns"]) and len(out["turns"]) == 2
    assert strip(json.loads(m) for m in sent_js) == strip(json.loads(m) for m in sent_py)
    assert want["turns"][0]["cached_tokens"] > out["turns"][0]["cached_tokens"]
    assert out["turns"][1]["folded_before"] == out["turns"][0]["folded_after"]
    settle(runtime, start)


def test_a_bundle_folder_runs_its_package_json_main():
    program = Program.load(JS / "debate")
    assert program.language == "javascript" and program.entry == "main.js"
    assert sorted(program.bundle) == ["agent.js", "main.js", "speak.js"]
    # a .js file beside a package.json runs with its folder's modules, itself the entry
    agent = Program.load(JS / "debate" / "agent.js")
    assert agent.bundle == program.bundle and agent.entry == "agent.js"
    # a folder with only its entry is a single file
    single = Program.load(JS / "top_a")
    assert single.bundle is None and single.source == (JS / "top_a" / "main.js").read_text()


def test_package_json_main_and_index_js_pick_the_entry(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "agent.js").write_text("export async function main(input) { return 1; }\n")
    (tmp_path / "src" / "util.js").write_text("export const x = 1;\n")
    (tmp_path / "package.json").write_text('{"main": "src/agent.js"}')
    assert Program.load(tmp_path).entry == "src/agent.js"
    (tmp_path / "package.json").write_text('{"main": "src/missing.js"}')
    with pytest.raises(FileNotFoundError, match='"main" is'):
        Program.load(tmp_path)
    (tmp_path / "package.json").write_text('{"name": "x"}')
    (tmp_path / "index.js").write_text("import { x } from './src/util.js';\nexport async function main() { return x; }\n")
    assert Program.load(tmp_path).entry == "index.js"


def test_the_debate_bundle_gives_the_python_original_arguments(runtime):
    """The JavaScript judge spawns agent.js three times; judge and agents talk by sendTo and
    receiveFrom. One round: every agent speaks first, so each argument is the Python debate's.
    (From round 2 on what an agent hears is in the order the others' arguments arrived.)"""
    given = {"rounds": 1, "max_tokens": 8}
    with pages_return(runtime):
        process = runtime.launch(JS / "debate", given, name="js-debate")
        events = list(process.events(timeout=300))
        out = process.result()
        want = runtime.launch(EXAMPLES / "agents" / "debate", given, name="py-debate").result(300)
    assert isinstance(events[-1], Done)
    assert out["agents"] == {s: f"js-debate/{s}" for s in ("for", "against", "undecided")}
    assert out["transcript"] == want["transcript"] and all(t["text"] for t in out["transcript"])
    assert [(d["stance"], d["fed"], d["folded"]) for d in out["agents_done"]] == \
        [(d["stance"], d["fed"], d["folded"]) for d in want["agents_done"]]


PY_PEER = """from inferlet import runtime, session

async def main(input):
    session.send_to(input["peer"], {"from": runtime.name(), "n": 1})
    sender, message = await session.receive_from()
    return {"sender": sender, "message": message}
"""

JS_PEER = """import { runtime, session } from 'inferlet';

export async function main(input) {
  const [sender, message] = await session.receiveFrom();
  session.sendTo(sender, { from: runtime.name(), n: message.n + 1, lang: 'javascript' });
  return { sender, message };
}
"""


def test_a_python_and_a_javascript_process_exchange_messages(runtime):
    with pages_return(runtime):
        js = runtime.launch(Program(source=JS_PEER, language="javascript"), {}, name="js-peer")
        py = runtime.launch(PY_PEER, {"peer": "js-peer"}, name="py-peer")
        assert js.result(120) == {"sender": "py-peer", "message": {"from": "py-peer", "n": 1}}
        assert py.result(120) == {"sender": "js-peer", "message": {"from": "js-peer", "n": 2, "lang": "javascript"}}


def test_a_child_spawned_from_source_runs_as_javascript(runtime):
    parent = """import { runtime } from 'inferlet';
export async function main(input) {
  const child = await runtime.spawn("export async function main(input) { return { twice: input.x * 2 }; }", { x: 21 });
  return await child.result();
}
"""
    assert run(runtime, Program(source=parent, language="javascript"), {}) == {"twice": 42}


def test_spawning_a_module_the_bundle_lacks_names_the_modules(runtime, tmp_path):
    (tmp_path / "main.js").write_text("import { runtime } from 'inferlet';\nimport { x } from './lib.js';\n"
                                      "export async function main(input) { await runtime.spawn('nope'); }\n")
    (tmp_path / "lib.js").write_text("export const x = 1;\n")
    from pie_actors.inferlet.host import InferletError
    with pytest.raises(InferletError, match=r"no module 'nope' \(modules: lib.js, main.js\)"):
        run(runtime, Program.load(tmp_path), {})


@pytest.mark.parametrize("example", ["completion_max", "run_ahead"])
def test_the_benchmarks_loops_give_the_python_originals_tokens(runtime, example):
    """The loops bench/concurrency.py runs in both languages: the same greedy tokens."""
    start = referenced(runtime)
    given = {"prompt": "The capital of France is", "max_tokens": 20}
    out = run(runtime, Program.load(JS / example / "main.js"), given)
    assert out == run(runtime, Program.load(EXAMPLES / example / "main.py"), given)
    settle(runtime, start)
