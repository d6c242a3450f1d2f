"""`pie run` runs the documents' programs: streamed text, then the returned JSON on its own line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pie_actors.cli import parse_inputs

ROOT = Path(__file__).resolve().parent.parent


def _pie_run(default_model_dir, *args: str) -> subprocess.CompletedProcess:
    pie = Path(sys.executable).parent / "pie"
    env = dict(os.environ, PIE_HOME=str(default_model_dir.parent.parent))
    return subprocess.run([str(pie), "run", "--dtype", "float32", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def test_quickstart_streams_then_prints_json(default_model_dir):
    out = _pie_run(default_model_dir, "examples/quickstart/main.py", "--",
                   "--question", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    *streamed, last = out.stdout.rstrip("\n").split("\n")
    result = json.loads(last)
    assert "Paris" in result["text"]
    assert "\n".join(streamed) == result["text"]


def test_quickstart_on_a_ray_cluster(default_model_dir):
    out = _pie_run(default_model_dir, "--ray", "examples/quickstart/main.py", "--",
                   "--question", "What is the capital of France?")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in json.loads(out.stdout.rstrip("\n").split("\n")[-1])["text"]


def test_failing_inferlet_exits_1_with_its_traceback(default_model_dir, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("async def main(input: dict) -> dict:\n    return {'x': 1 / input['zero']}\n")
    out = _pie_run(default_model_dir, str(bad), "--", "--zero", "0")
    assert out.returncode == 1
    assert "ZeroDivisionError" in out.stderr and "line 2" in out.stderr


def test_missing_inferlet_is_one_clear_line(default_model_dir):
    out = _pie_run(default_model_dir, "no/such/main.py")
    assert out.returncode == 1 and "no inferlet at no/such/main.py" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_bundle_with_its_own_module_builds_and_runs(default_model_dir, tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "greeting.py").write_text("def greet(name):\n    return 'hello ' + name\n")
    (bundle / "main.py").write_text("from inferlet import model\nfrom greeting import greet\n\n"
                                    "async def main(input):\n"
                                    "    return {'msg': greet(input['name']), 'n': len(model.encode('hi'))}\n")
    pie = Path(sys.executable).parent / "pie"
    built = subprocess.run([str(pie), "build", str(bundle)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0 and "greeting" in built.stdout, built.stderr
    out = _pie_run(default_model_dir, str(bundle), "--", "--name", "pie")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip()) == {"msg": "hello pie", "n": 1}


def test_input_arguments_parse_as_json_when_they_can():
    assert parse_inputs(["--question", "What is 2+2?", "--n", "3", "--t", "0.5", "--stream",
                         "--tags", '["a", "b"]']) == \
        {"question": "What is 2+2?", "n": 3, "t": 0.5, "stream": True, "tags": ["a", "b"]}
    with pytest.raises(ValueError, match="--key value"):
        parse_inputs(["question", "x"])
