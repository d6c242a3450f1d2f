"""The collective interface of tensor-parallel ranks (gpu/model/tp.py): which implementation a rank
joins, and the contract every one keeps, checked on two gloo ranks (CPU). The CUDA one (NCCL via
cupy) keeps the same contract; it needs a GPU and cupy, which these machines lack, and says so."""
from __future__ import annotations

import socket
import sys

import pytest
import ray
import ray.cloudpickle
import torch

from pie_actors.gpu.model.tp import NCCL_DTYPES, CupyNcclComm, TorchDistComm, join_group

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the ranks below run this file's code


def contract(comm) -> dict:
    """What one rank sees of each collective, on tensors that depend on its rank."""
    r, n = comm.rank, comm.world_size
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1)
    reduced = comm.all_reduce(x.clone())
    gathered = comm.all_gather(torch.full((2, 1), float(r)), dim=-1)
    plan = comm.broadcast_object({"from": r, "plan": [1, 2, 3]} if r == 0 else None)
    return {"rank": r, "world": n, "reduced": reduced.tolist(), "gathered": gathered.tolist(), "plan": plan}


@ray.remote(num_cpus=0)
class Rank:
    def run(self, rank: int, world: int, init_method: str) -> dict:
        comm = join_group(rank, world, init_method, torch.device("cpu"))
        try:
            return {**contract(comm), "kind": type(comm).__name__}
        finally:
            comm.close()


def test_two_gloo_ranks_keep_the_contract():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = f"tcp://127.0.0.1:{port}"
        ranks = [Rank.remote() for _ in range(2)]
        results = ray.get([a.run.remote(i, 2, init) for i, a in enumerate(ranks)], timeout=120)
    finally:
        ray.shutdown()
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for i, got in enumerate(results):
        assert got["kind"] == "TorchDistComm" and (got["rank"], got["world"]) == (i, 2)
        assert got["reduced"] == (base * 1 + base * 2).tolist()                 # the sum over ranks
        assert got["gathered"] == [[0.0, 1.0], [0.0, 1.0]]                      # in rank order along dim
        assert got["plan"] == {"from": 0, "plan": [1, 2, 3]}                    # rank 0's object everywhere


def test_cuda_ranks_join_cupys_nccl_and_cpu_ranks_gloo():
    assert issubclass(CupyNcclComm, TorchDistComm)           # plans travel over the same gloo group
    try:
        import cupy  # noqa: F401
    except ImportError:
        # this machine has no cupy: a CUDA rank says what to install before it joins anything
        with pytest.raises(RuntimeError, match="cupy's NCCL: pip install cupy-cuda12x"):
            join_group(0, 2, "tcp://127.0.0.1:1", torch.device("cuda"))
    assert set(NCCL_DTYPES) == {"float32", "float16", "bfloat16", "int32", "int64"}
