"""Everywhere a Python program goes, a JavaScript one goes too: `pie run main.js -- --key value`,
`pie run` of a bundle folder, `pie-client submit --path main.js`, a [serve.routes] endpoint written
in JavaScript answering the official openai SDK (streaming and not); `ray job submit` of a
JavaScript bundle is in tests/test_jobs.py, beside a Python one on the same cluster."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from pie_actors.inferlet.build import JS_DIR
from serve_helpers import ASK, KEY, chat_prompt, greedy_text, start

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (JS_DIR / "node_modules" / ".bin" / "componentize-js").is_file(),
    reason="the JavaScript runner needs node and componentize-js (make setup)")

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
QUICKSTART = "examples/js/quickstart/main.js"
ENDPOINT = ROOT / "examples" / "js" / "serve_endpoint" / "main.js"
CAPTAIN = "You are the captain of a sailing ship. Answer in one sentence."
GREETING = "export const greet = (name) => `hello ${name}`;\n"
AGENT = """import { model } from 'inferlet';
import { greet } from './lib/greeting.js';

export async function main(input) {
  return { greeting: greet(input.name), model: model.name() };
}
"""


def _bundle(folder: Path) -> Path:
    (folder / "lib").mkdir(parents=True)
    (folder / "lib" / "greeting.js").write_text(GREETING)
    (folder / "main.js").write_text(AGENT)
    (folder / "package.json").write_text('{"name": "greeter", "version": "0.2.0", "main": "main.js"}')
    return folder


def _env(default_model_dir) -> dict[str, str]:
    return dict(os.environ, PIE_HOME=str(default_model_dir.parent.parent),
                PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def _streamed_then_json(stdout: str) -> tuple[str, dict]:
    *streamed, last = stdout.rstrip("\n").split("\n")
    return "\n".join(streamed), json.loads(last)


def test_pie_run_runs_a_js_file_and_a_bundle_folder(default_model_dir, tmp_path):
    def pie_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "pie"), "run", "--local", "--dtype", "float32", "--compile", "off", *args],
                              capture_output=True, text=True, timeout=300, env=_env(default_model_dir), cwd=ROOT)

    out = pie_run(QUICKSTART, "--", "--question", "What is the capital of France?")
    assert out.returncode == 0, out.stderr[-2000:]
    streamed, result = _streamed_then_json(out.stdout)
    assert "Paris" in result["text"] and streamed == result["text"]

    bundle = _bundle(tmp_path / "greeter")
    out = pie_run(str(bundle), "--", "--name", "pie")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == {"greeting": "hello pie", "model": "smollm2-135m-instruct"}


def test_a_js_endpoint_answers_the_openai_sdk_and_pie_client_submits_a_js_file(default_model_dir):
    with start(default_model_dir, api_keys=(KEY,), routes={"/v1/chat/completions": str(ENDPOINT)}) as server:
        expected = greedy_text(server, chat_prompt(server, [{"role": "system", "content": CAPTAIN}, *ASK]), 40)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        reply = client.chat.completions.create(model="default", messages=ASK, max_tokens=40)
        assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
        assert reply.usage.prompt_tokens == len(chat_prompt(server, [{"role": "system", "content": CAPTAIN}, *ASK]))
        chunks = list(client.chat.completions.create(model="default", messages=ASK, max_tokens=40, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]

        env = {k: v for k, v in os.environ.items() if k not in ("PIE_URL", "PIE_API_KEY")}
        out = subprocess.run([str(BIN / "pie-client"), "submit", "--path", QUICKSTART, "--", "--question",
                              "What is the capital of France?"], capture_output=True, text=True, timeout=120,
                             cwd=ROOT, env=dict(env, PIE_URL=server.url, PIE_API_KEY=KEY))
        assert out.returncode == 0, out.stderr[-2000:]
        streamed, result = _streamed_then_json(out.stdout)
        assert "Paris" in result["text"] and streamed == result["text"]


def test_pie_build_says_a_js_bundle_needs_no_build():
    out = subprocess.run([str(BIN / "pie"), "build", "examples/js/debate"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("a JavaScript program runs on the JavaScript runner: nothing to build "
                          "(modules: agent.js, main.js, speak.js)\n")
