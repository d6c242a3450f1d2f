"""A launch that finds every inferlet host actor full, and no node that may start another, fails at
once with an error that names both bounds; once processes end there is room again."""
from __future__ import annotations

import pytest

from pie_actors.controller import ClusterFull
from tests.cluster_helpers import DUMMY, HOLDER, ready, until
from tests.inferlet_helpers import on_a_cluster


def test_no_room_left_is_a_clear_error_naming_the_bound():
    with on_a_cluster(inferlets_per_actor=2, actors_per_node=1, spare_actors=0, **DUMMY) as runtime:
        held = [runtime.launch(HOLDER, {"prompt": [1 + i, 2, 3], "n": 3}) for i in range(2)]
        ready(held)
        with pytest.raises(ClusterFull, match="actors_per_node = 1") as full:
            runtime.launch(HOLDER, {"prompt": [3, 2, 3], "n": 3})
        assert "inferlets_per_actor = 2" in str(full.value)
        for p in held:
            p.send("go")
            p.result(120)
        until(lambda: runtime.running(None) == 0)                  # their ends reached the Controller
        third = runtime.launch(HOLDER, {"prompt": [3, 2, 3], "n": 3})             # room again
        ready([third])
        third.send("go")
        assert third.result(120)["tokens"]
        until(lambda: runtime.stats()["kv"]["referenced"] == 0)
