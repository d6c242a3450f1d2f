"""Saved working sets: `ws.save(name)` in one process, `WorkingSet.open(name)` in a later one of the
same owner continues with the tokens an unbroken run gives, whether the set's pages were kept, spilled
to host memory under page pressure, or dropped and recomputed from its tokens; names are per owner;
deleting returns every page."""
from __future__ import annotations

import time

import pytest

from pie_actors import InferletError, Runtime

# 12 pages of 16 tokens; a set of 17-32 tokens holds 2 pages (1.4 MiB in float32), and the 2 MiB
# spill buffer holds one such set.
SETTINGS = dict(dtype="float32", num_pages=12, spill_memory_mb=2, timeout_s=120, compile="off")
PROMPTS = {"a": "The capital of France is Paris, the capital of Spain is Madrid, and the capital of Italy is",
           "b": "Water boils at one hundred degrees Celsius at sea level, and at the top of a high mountain it"}
STEPS = 6                     # tokens decoded before the save, and again after the open

DECODE = """
from inferlet import model
from inferlet.eta import ForwardPass, Pipeline, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    if "open" in input:
        ws, feed = WorkingSet.open(input["open"]), [input["next"]]
    else:
        ws, feed = WorkingSet(), model.encode(input["prompt"])
    pipe, out = Pipeline(), []
    for _ in range(input["steps"]):
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws])
        token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        out.append(await token)
        feed = [out[-1]]
    saved = ws.save(input["save"]) if "save" in input else None
    return {"tokens": out, "restored": ws.restored, "saved": saved, "listed": WorkingSet.saved()}
"""

HOG = """
from inferlet.eta import ForwardPass, Pipeline, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, fwd = WorkingSet(), ForwardPass()
    fwd.embed([100 + i for i in range(input["tokens"])])
    fwd.state([ws])
    token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    Pipeline().submit(fwd)
    return {"token": await token}
"""

DELETE = """
from inferlet.eta import WorkingSet

async def main(input):
    WorkingSet.delete_saved(input["name"])
    return {"left": [s["name"] for s in WorkingSet.saved()]}
"""


@pytest.fixture(scope="module")
def runtime(default_model_dir):
    with Runtime.local(str(default_model_dir), **SETTINGS) as rt:
        yield rt


def _run(runtime: Runtime, source: str, owner: str | None = "alice", **input) -> dict:
    return runtime.launch(source, input, owner=owner).result()


def _idle(runtime: Runtime) -> dict:
    end = time.monotonic() + 30
    while (stats := runtime.stats())["connections"] or stats["processes"]:
        assert time.monotonic() < end, "processes did not end"
        time.sleep(0.05)
    return stats


def _states(runtime: Runtime, owner: str = "alice") -> dict[str, str]:
    return {s["name"]: s["state"] for s in runtime.saved(owner)}


def test_reopened_sets_continue_like_an_unbroken_run(runtime):
    unbroken = {k: _run(runtime, DECODE, prompt=p, steps=2 * STEPS)["tokens"] for k, p in PROMPTS.items()}
    first = {k: _run(runtime, DECODE, prompt=p, steps=STEPS, save=k) for k, p in PROMPTS.items()}
    for k in PROMPTS:
        assert first[k]["tokens"] == unbroken[k][:STEPS]
        assert 16 < first[k]["saved"] <= 32            # two pages each
    assert first["b"]["listed"] == [{"name": "a", "state": "kept", "tokens": first["a"]["saved"]},
                                    {"name": "b", "state": "kept", "tokens": first["b"]["saved"]}]
    assert _states(runtime) == {"a": "kept", "b": "kept"}

    # A pass needing 11 of the 12 pages evicts both sets, least recently saved first: "a" fits the
    # spill buffer, "b" no longer does and keeps only its tokens.
    _run(runtime, HOG, tokens=170)
    assert _states(runtime) == {"a": "spilled", "b": "tokens"}
    assert _idle(runtime)["saved"]["spill_bytes"] > 0

    def reopen(k: str) -> dict:
        return _run(runtime, DECODE, open=k, next=first[k]["tokens"][-1], steps=STEPS)

    spilled, recomputed, kept = reopen("a"), reopen("b"), reopen("a")
    assert (spilled["restored"], recomputed["restored"], kept["restored"]) == ("spilled", "recomputed", "kept")
    for reopened, k in ((spilled, "a"), (recomputed, "b"), (kept, "a")):
        assert first[k]["tokens"] + reopened["tokens"][:-1] == unbroken[k][:2 * STEPS - 1]
    stats = _idle(runtime)["saved"]
    assert (stats["opened_kept"], stats["opened_spilled"], stats["opened_recomputed"]) == (1, 1, 1)
    assert (stats["kept"], stats["spill_bytes"]) == (1, 0)   # "a" is back in the pool, "b" tokens only


def test_names_are_per_owner_and_delete_returns_every_page(runtime):
    _run(runtime, DECODE, prompt=PROMPTS["a"], steps=2, save="mine")
    assert "mine" in _states(runtime)
    for other in ("bob", None):
        assert runtime.saved(other) == []
        with pytest.raises(InferletError, match="no saved working set named 'mine'"):
            _run(runtime, DECODE, owner=other, open="mine", next=0, steps=1)
        with pytest.raises(KeyError):
            runtime.delete_saved("mine", other)

    assert _run(runtime, DELETE, name="mine")["left"] == sorted(set(_states(runtime)))
    for name in list(_states(runtime)):
        runtime.delete_saved(name, "alice")
    stats = _idle(runtime)
    assert runtime.saved("alice") == []
    assert stats["kv"]["referenced"] == 0
    assert (stats["saved"]["kept"], stats["saved"]["spilled"], stats["saved"]["tokens"]) == (0, 0, 0)
    runtime.engine.kv.check()
