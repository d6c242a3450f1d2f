"""`pie run` runs the documents' programs: streamed text, then the returned JSON on its own line;
`pie-client` does the same on a running pie serve, and follows, messages and kills its processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_helpers import ray_head
from pie_actors.cli import parse_inputs
from serve_helpers import KEY, start

ROOT = Path(__file__).resolve().parent.parent


# Ray's notice that it turned token authentication on (its default for a new local cluster) and the
# one for detached actors in an anonymous namespace: not the product's lines
RAY_NOTICES = ("Token authentication is enabled", "anonymous namespace")


def _pie_run(default_model_dir, *args: str) -> subprocess.CompletedProcess:
    pie = Path(sys.executable).parent / "pie"
    env = dict(os.environ, PIE_HOME=str(default_model_dir.parent.parent))
    env.pop("RAY_AUTH_MODE", None)                 # Ray's default, as a user has it
    return subprocess.run([str(pie), "run", "--dtype", "float32", "--compile", "off", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)


@pytest.mark.parametrize("where", [[], ["--local"]], ids=["ray", "local"])
def test_quickstart_streams_then_prints_json(default_model_dir, where):
    """By default `pie run` starts a local Ray cluster (none runs here) and uses its Controller, and
    prints none of Ray's notices; --local runs everything in the process."""
    out = _pie_run(default_model_dir, *where, "examples/quickstart/main.py", "--",
                   "--question", "What is the capital of France?")
    assert out.returncode == 0, out.stderr[-2000:]
    assert not [line for line in out.stderr.splitlines() if any(n in line for n in RAY_NOTICES)], out.stderr
    *streamed, last = out.stdout.rstrip("\n").split("\n")
    result = json.loads(last)
    assert "Paris" in result["text"]
    assert "\n".join(streamed) == result["text"]


FILES = """
from inferlet import session

async def main(input):
    data = session.file("notes")
    session.send_file(data[::-1])
    return {"size": len(data), "head": data[:5].decode()}
"""


def test_attached_files_are_read_and_sent_files_written(default_model_dir, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"hello \x00\xff world")
    prog = tmp_path / "files.py"
    prog.write_text(FILES)
    out = _pie_run(default_model_dir, "--local", "--file", f"notes={notes}", "--files-out",
                   str(tmp_path / "out"), str(prog))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip()) == {"size": 14, "head": "hello"}
    assert (tmp_path / "out" / "file-1.bin").read_bytes() == notes.read_bytes()[::-1]
    missing = _pie_run(default_model_dir, "--local", str(prog))
    assert missing.returncode == 1 and "no file named 'notes' was attached" in missing.stderr


def test_failing_inferlet_exits_1_with_its_traceback(default_model_dir, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("async def main(input: dict) -> dict:\n    return {'x': 1 / input['zero']}\n")
    out = _pie_run(default_model_dir, "--local", str(bad), "--", "--zero", "0")
    assert out.returncode == 1
    assert "ZeroDivisionError" in out.stderr and "line 2" in out.stderr


@pytest.mark.parametrize("where", [[], ["--local"]], ids=["ray", "local"])
def test_missing_inferlet_is_one_clear_line(default_model_dir, where):
    """Said before anything starts: no engine loads and no Ray cluster starts for a wrong path."""
    out = _pie_run(default_model_dir, *where, "no/such/main.py")
    assert out.returncode == 1 and "no inferlet at no/such/main.py" in out.stderr
    assert "Traceback" not in out.stderr and "Ray" not in out.stderr and "engine" not in out.stderr


def test_input_arguments_parse_as_json_when_they_can():
    assert parse_inputs(["--question", "What is 2+2?", "--n", "3", "--t", "0.5", "--stream",
                         "--tags", '["a", "b"]']) == \
        {"question": "What is 2+2?", "n": 3, "t": 0.5, "stream": True, "tags": ["a", "b"]}
    assert parse_inputs(["--", "--n", "3"]) == {"n": 3}          # the -- that argparse may keep
    with pytest.raises(ValueError, match="--key value"):
        parse_inputs(["question", "x"])


def test_a_stale_cluster_address_file_is_not_joined(tmp_path, monkeypatch):
    """`ray start` leaves its address in a file that outlives a killed cluster; Ray itself would
    wait minutes on that address. pie finds nothing running and says so (or starts its own)."""
    import socket

    from pie_actors.runtime import cluster_address
    with socket.socket() as s:                        # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    address_file = tmp_path / "ray" / "ray_current_cluster"
    address_file.parent.mkdir()
    address_file.write_text(dead)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address() is None
    assert cluster_address("10.0.0.1:6379") == "10.0.0.1:6379"      # an address asked for is kept
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        address_file.write_text(f"127.0.0.1:{live.getsockname()[1]}")
        assert cluster_address() == f"127.0.0.1:{live.getsockname()[1]}"


WAITER = """
from inferlet import session

async def main(input):
    session.send("waiting")
    return {"got": await session.receive()}
"""


def test_pie_client_submits_to_a_running_server_and_talks_to_its_processes(default_model_dir, tmp_path):
    """`pie-client submit` streams like `pie run`; a detached process is listed, messaged, followed
    again and killed by the id the server gave it."""
    prog = tmp_path / "waiter.py"
    prog.write_text(WAITER)
    with start(default_model_dir, api_keys=(KEY,)) as server:
        env = {k: v for k, v in os.environ.items() if k not in ("PIE_URL", "PIE_API_KEY")}

        def client(*args: str, key: str = KEY) -> subprocess.CompletedProcess:
            return subprocess.run([str(Path(sys.executable).parent / "pie-client"), *args], capture_output=True,
                                  text=True, timeout=120, cwd=ROOT, env=dict(env, PIE_URL=server.url, PIE_API_KEY=key))

        out = client("submit", "--path", "examples/quickstart/main.py", "--", "--question",
                     "What is the capital of France?")
        assert out.returncode == 0, out.stderr[-2000:]
        *streamed, last = out.stdout.rstrip("\n").split("\n")
        result = json.loads(last)
        assert "Paris" in result["text"] and "\n".join(streamed) == result["text"]

        one, two = (client("submit", "--detach", "--path", str(prog)).stdout.strip() for _ in range(2))
        listed = subprocess.run([str(Path(sys.executable).parent / "pie-client"), "ps", "--url", server.url,
                                 "--api-key", KEY], capture_output=True, text=True, timeout=120, env=env)
        rows = {line.split()[0]: line.split()[2:4] for line in listed.stdout.splitlines()[1:]}
        assert rows == {one: ["running", "no"], two: ["running", "no"]}
        assert client("send", one, '{"n": 1}').returncode == 0
        assert client("attach", one).stdout == 'waiting\n{"got": {"n": 1}}\n'
        assert client("kill", two).returncode == 0
        killed = client("attach", two)
        assert killed.returncode == 1 and "inferlet cancelled: killed by request" in killed.stderr
        missing = client("send", two, "hi")
        assert missing.returncode == 1 and f"not_found: no process {two!r}" in missing.stderr
        assert client("ps").stdout.splitlines()[1:] == []
        refused = client("ps", key="not-a-key")
        assert refused.returncode == 1 and refused.stderr == "pie-client: error: invalid_key: the API key is not valid\n"


def test_pie_run_joins_a_kept_cluster_and_its_engine_stays(default_model_dir, tmp_path):
    """`ray start --head` keeps a cluster up between commands: each `pie run` joins it, and the
    Controller keeps the model's engine, so the second run starts none. The second is a built
    bundle with a module of its own, shipped to the cluster's inferlet actor."""
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PIE_HOME=str(default_model_dir.parent.parent))
    prog = tmp_path / "name.py"
    prog.write_text("from inferlet import model\n\nasync def main(input):\n    return {'model': model.name()}\n")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "greeting.py").write_text("def greet(name):\n    return 'hello ' + name\n")
    (bundle / "main.py").write_text("from inferlet import model\nfrom greeting import greet\n\n"
                                    "async def main(input):\n"
                                    "    return {'msg': greet(input['name']), 'model': model.name()}\n")
    built = subprocess.run([str(bin_dir / "pie"), "build", str(bundle)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0 and "greeting" in built.stdout, built.stderr
    status = ("import json, ray; from pie_actors.controller import NAME, NAMESPACE; ray.init(address='auto'); "
              "s = ray.get(ray.get_actor(NAME, namespace=NAMESPACE).status.remote()); print(json.dumps({'engines': list(s.engines), 'launches': s.launches}))")
    with ray_head(env) as (env, _):
        runs = ([str(prog)], {"model": "smollm2-135m-instruct"}), \
               ([str(bundle), "--", "--name", "pie"], {"msg": "hello pie", "model": "smollm2-135m-instruct"})
        for args, want in runs:
            run = subprocess.run([str(bin_dir / "pie"), "run", "--dtype", "float32", "--compile", "off", *args],
                                 capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
            assert run.returncode == 0, run.stderr[-2000:]
            assert json.loads(run.stdout.strip().splitlines()[-1]) == want
        after = json.loads(subprocess.run([sys.executable, "-c", status], capture_output=True, text=True,
                                          timeout=120, env=env, check=True).stdout.strip().splitlines()[-1])
        assert list(after["engines"]) == ["smollm2-135m-instruct"] and after["launches"] == 2
