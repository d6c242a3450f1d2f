"""A run whose engine is chosen at its first pass (run_state.EngineChoice), as plain classes: the
choice gets that pass's tokens, what the run made before it (working sets, channels, puts,
epilogues) reaches the engine in order, and a refusal among those is a clear error that loses
nothing. On a cluster the Controller makes the choice (test_cluster.py)."""
from __future__ import annotations

from typing import Any

from pie_actors import Runtime
from pie_actors.config import RunLimits
from pie_actors.inferlet.run import Run
from pie_actors.inferlet.run_state import EngineChoice
from pie_actors.launch import Launch
from pie_actors.process import Done, Failed
from pie_actors.program import Program
from tests.cluster_helpers import FED, GREEDY
from tests.inferlet_helpers import referenced, settle

PROMPT = [504, 3458, 282, 4649, 314, 1345, 28]

# its first engine operation is not a pass: the choice has no prefix to go by
SAVED_FIRST = """
from inferlet.eta import WorkingSet

async def main(input):
    return {"saved": len(WorkingSet.saved())}
"""
# a channel the engine refuses, made before the first pass
BAD_CHANNEL = """
from inferlet.eta import Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    too_big = Channel([1 << 30], "f32")
    fwd = ForwardPass()
    fwd.embed([1, 2, 3])
    fwd.state([ws], StateGeometry.folding())

    def pick():
        too_big.put(intrinsics.output(0, "logits"))
    fwd.epilogue(pick)
    pipe.submit(fwd)
    return {}
"""


def _run(runtime: Runtime, source: str, input: Any) -> tuple[Any, list]:
    """The last event of a run of `source` whose engine (this runtime's) is chosen at its first pass,
    and the prefixes it was chosen by."""
    chosen: list = []

    def choose(prefix: list[int] | None, timeout: float):
        assert timeout > 0
        chosen.append(prefix)
        return runtime.engine_address

    events: list = []
    choice = EngineChoice(runtime._backend.server.info, choose)
    Run(Launch(Program.load(source), input, limits=RunLimits(timeout_s=120)), choice, events.append).run()
    return events[-1], chosen


def test_the_first_pass_chooses_by_its_tokens_and_what_came_before_it_follows(runtime):
    start = referenced(runtime)
    end, chosen = _run(runtime, FED, {"prompt": PROMPT, "n": 6})
    assert isinstance(end, Done), end
    assert chosen == [PROMPT]                                        # once, by the first pass's tokens
    want = runtime.launch(GREEDY, {"prompt": PROMPT, "n": 6}).result(timeout=120)["tokens"]
    assert end.output["tokens"] == want                              # its channels and epilogue were sent
    settle(runtime, start)


def test_an_operation_before_any_pass_chooses_without_a_prefix(runtime):
    end, chosen = _run(runtime, SAVED_FIRST, {})
    assert isinstance(end, Done) and end.output == {"saved": 0}
    assert chosen == [None]


def test_a_refused_channel_made_before_the_first_pass_fails_that_pass_clearly(runtime):
    start = referenced(runtime)
    end, chosen = _run(runtime, BAD_CHANNEL, {})
    assert isinstance(end, Failed), end
    assert "before its engine was chosen" in end.message and "ChannelError" in end.message, end.message
    assert chosen == [[1, 2, 3]]
    settle(runtime, start)
    assert runtime.stats()["channels"] == 0
