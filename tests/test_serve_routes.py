"""pie serve's replaceable endpoints, an endpoint that fails, /health before the engine serves, and the
`pie serve` command."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from serve_helpers import ASK, KEY, chat_prompt, greedy_text, idle, start

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "serve_endpoint" / "main.py"
CAPTAIN = "You are the captain of a sailing ship. Answer in one sentence."
FAILING = '''
async def main(input):
    raise RuntimeError("this endpoint is broken on purpose")
'''


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    broken = tmp_path_factory.mktemp("routes") / "broken.py"
    broken.write_text(FAILING)
    with start(default_model_dir, routes={"/v1/chat/completions": str(EXAMPLE), "/v1/completions": str(broken)}) as s:
        yield s


def test_a_replaced_endpoint_serves_the_chat_route(server):
    expected = greedy_text(server, chat_prompt(server, [{"role": "system", "content": CAPTAIN}, *ASK]), 40)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="default", messages=ASK, max_tokens=40)
    assert reply.choices[0].message.content == expected
    chunks = client.chat.completions.create(model="default", messages=ASK, max_tokens=40, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    # the other APIs still get the built-in endpoint: its answer has no captain in it
    other = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages.create(
        model="default", max_tokens=40, messages=ASK, extra_body={"temperature": 0})
    assert other.content[0].text == greedy_text(server, chat_prompt(server, ASK), 40) != expected


def test_an_endpoint_that_fails_is_a_500_with_its_message_and_the_server_goes_on(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as failed:
            client.completions.create(model="default", prompt="Hello", max_tokens=4, stream=stream)
        assert "broken on purpose" in str(failed.value)
    assert idle(server)["kv"]["referenced"] == 0
    assert "Paris" in client.chat.completions.create(model="default", messages=ASK, max_tokens=40).choices[0].message.content


def test_an_unknown_route_in_the_config_is_refused(default_model_dir):
    with pytest.raises(ValueError, match="/v1/chat/completion"):
        start(default_model_dir, routes={"/v1/chat/completion": str(EXAMPLE)})


def _pie(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pie_actors.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _line(process: subprocess.Popen, starts: str) -> str:
    for line in process.stdout:
        if line.startswith(starts):
            return line
    raise AssertionError(f"pie serve exited ({process.wait()}) without printing {starts!r}")


def test_health_is_503_until_the_engine_serves_and_a_failed_load_says_why(default_model_dir, tmp_path):
    """The app listens before the engine loads: /health is 503 meanwhile, and stays 503 with the
    loader's error when the weights cannot be read; requests get that error in their API's shape
    instead of waiting."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in default_model_dir.iterdir():
        if item.name != "model.safetensors":
            (broken / item.name).symlink_to(item)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    server = start(broken).start()
    try:
        first = httpx.get(server.url + "/health")
        assert first.status_code == 503 and first.json()["status"] in ("loading", "failed")
        with pytest.raises(RuntimeError, match="not a readable safetensors file"):
            server.wait_ready(120)
        failed = httpx.get(server.url + "/health")
        assert failed.status_code == 503 and failed.json()["status"] == "failed"
        assert "not a readable safetensors file" in failed.json()["error"]
        with pytest.raises(openai.InternalServerError, match="safetensors") as refused:
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
                model="default", messages=ASK, max_tokens=4)
        assert refused.value.status_code == 503
    finally:
        server.close()


def test_pie_serve_local_with_keys_from_the_environment(default_model_dir, tmp_path):
    env = {**os.environ, "PIE_API_KEYS": f" {KEY} ,", "PYTHONPATH": os.pathsep.join(sys.path)}
    process = _pie("--local", "--port", "0", "--model", str(default_model_dir), "--dtype", "float32",
                   "--compile", "off", "--served-model-name", "captain", env=env)
    try:
        url = _line(process, "pie serve: http").split()[2]
        _line(process, "pie serve: the engine is loaded")
        assert httpx.get(url + "/health").json()["status"] == "ok"
        assert httpx.get(url + "/v1/models").status_code == 401
        names = [m["id"] for m in httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).json()["data"]]
        assert names == ["default", "smollm2-135m-instruct", "captain"]
        reply = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
            model="captain", messages=ASK, max_tokens=16, temperature=0)
        assert "Paris" in reply.choices[0].message.content
    finally:
        process.terminate()
        process.wait(60)


def _children(pid: int) -> set[int]:
    return {int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()}


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow to collect it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_pie_serve_local_runs_its_engine_in_a_child_that_ends_with_it(default_model_dir):
    env = {**os.environ, "PIE_API_KEYS": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    process = _pie("--local", "--port", "0", "--model", str(default_model_dir), "--dtype",
                   "float32", "--compile", "off", env=env)
    try:
        url = _line(process, "pie serve: http").split()[2]
        _line(process, "pie serve: the engine is loaded")
        engines = _children(process.pid)
        assert engines                                       # the engine's own process
        reply = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="default", messages=ASK, max_tokens=16, temperature=0)
        assert "Paris" in reply.choices[0].message.content
    finally:
        process.terminate()
        process.wait(60)
    end = time.monotonic() + 60
    while any(_running(pid) for pid in engines):
        assert time.monotonic() < end, "the engine's process outlived pie serve"
        time.sleep(0.1)


def test_pie_serve_one_process_needs_local():
    out = subprocess.run([sys.executable, "-m", "pie_actors.cli", "serve", "--one-process"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "--one-process goes with --local" in out.stderr


def test_pie_serve_without_keys_says_it_is_open(default_model_dir):
    env = {**os.environ, "PIE_API_KEYS": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    process = _pie("--local", "--port", "0", "--model", str(default_model_dir), "--compile", "off", env=env)
    try:
        assert "single-user" in _line(process, "pie serve: no API keys")
    finally:
        process.terminate()
        process.wait(60)


def test_pie_serve_keeps_the_ray_cluster_it_starts(default_model_dir):
    """Without --local and with no cluster running, pie serve starts a Ray cluster of its own. Its
    processes die with the thread that starts them: started by the engine's loader thread, they
    were gone as soon as the engine had loaded, and every request after that failed."""
    env = {**os.environ, "PIE_API_KEYS": KEY, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RAY_ADDRESS", None)
    process = _pie("--port", "0", "--model", str(default_model_dir), "--dtype", "float32", "--compile", "off",
                   env=env)
    try:
        url = _line(process, "pie serve: http").split()[2]
        _line(process, "pie serve: the engine is loaded")
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        for _ in range(2):                            # the second one after the first's actor went back
            reply = client.chat.completions.create(model="default", messages=ASK, max_tokens=16, temperature=0)
            assert "Paris" in reply.choices[0].message.content
    finally:
        process.terminate()
        process.wait(60)
