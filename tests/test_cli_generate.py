"""`pie generate` (what `make demo` runs) streams a real answer from the default model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_pie_generate_answers_through_the_chat_template(default_model_dir):
    pie = Path(sys.executable).parent / "pie"
    env = dict(os.environ, PIE_HOME=str(default_model_dir.parent.parent))
    out = subprocess.run([str(pie), "generate", "--chat", "--max-tokens", "32", "--dtype", "float32",
                          "--prompt", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_pie_generate_unknown_model_is_one_clear_line(default_model_dir):
    pie = Path(sys.executable).parent / "pie"
    env = dict(os.environ, PIE_HOME=str(default_model_dir.parent.parent))
    out = subprocess.run([str(pie), "generate", "--model", "no-such-model", "--prompt", "hi"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1
    assert "unknown model 'no-such-model'" in out.stderr and "Traceback" not in out.stderr
