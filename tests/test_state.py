"""Full checkpoints of a sharded model: fxshard.full_state_dict gathers the
single-device state_dict, fxshard.load_full_state_dict gives every rank its slice."""
from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import MeshSpec, Plan, colwise
from fxshard.testing.models import LlamaArgs, llama, llama_plan, tokens

from equivalence import coords_of, slice_for
from harness import make_mesh, plain, rank_map, rank_value, simulated, spawn
from fxshard.meta import program_meta

IDS = tokens(4, 8, 128, seed=1)


def _plans():
    """(name, model factory, mesh shape, plan factory): 1-D tp, fused q/k/v and w1/w3
    (each part sharded on its own), and dp x tp with the batch on dp."""
    fused = LlamaArgs(n_heads=8, n_kv_heads=4, fused_qkv=True, fused_w13=True)
    kv2 = {**llama_plan("tp"), "layers.*.attention.wk": colwise(heads=2), "layers.*.attention.wv": colwise(heads=2)}
    return [
        ("tp=4", functools.partial(llama, n_heads=8, n_kv_heads=4), {"tp": 4},
         lambda mesh: Plan(mesh, llama_plan("tp"))),
        ("tp=2 fused", functools.partial(llama, args=fused), {"tp": 2},
         lambda mesh: Plan(mesh, llama_plan("tp", fused=True, args=fused))),
        ("dp=2 x tp=2", functools.partial(llama, n_heads=8, n_kv_heads=4), {"dp": 2, "tp": 2},
         lambda mesh: Plan(mesh, llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}})),
        # 2 KV heads on 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1; gathered once each
        ("tp=4 kv heads replicated", functools.partial(llama, n_heads=8, n_kv_heads=2), {"tp": 4},
         lambda mesh: Plan(mesh, kv2)),
    ]


def _modified(sd: dict) -> dict:
    """Another full state dict of the same shapes (every entry different)."""
    g = torch.Generator().manual_seed(7)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in sd.items()}


def _expected_local(full: torch.Tensor, fqn: str, sharded, coord, mesh_shape) -> torch.Tensor:
    """The slice a rank holds: fused parameters are sharded part by part."""
    layout, _ = program_meta(sharded).state[fqn]
    return slice_for(full, layout, coord, mesh_shape, program_meta(sharded).blocks.get(fqn),
                     heads=program_meta(sharded).heads.get(fqn))


def _check_round_trip(sharded, model, mesh_shape, ranks, coord_of) -> None:
    """full_state_dict == the model's; load a modified one, each rank holds its slice;
    gathering again gives the modified one back."""
    want = model.state_dict()
    got = fxshard.full_state_dict(sharded)
    assert got.keys() == want.keys()
    for r in ranks:
        with plain():
            for k in want:
                assert torch.equal(rank_value(got[k], r), want[k]), f"rank {r}: full_state_dict()[{k!r}]"
    with plain():  # under simulated ranks, randn would make one tensor per rank
        new = _modified(want)
    fxshard.load_full_state_dict(sharded, new)
    local = sharded.state_dict()
    again = fxshard.full_state_dict(sharded)
    for r in ranks:
        with plain():
            for k in want:
                exp = _expected_local(new[k], k, sharded, coord_of(r), mesh_shape)
                assert torch.equal(rank_value(local[k], r), exp), f"rank {r}: local {k!r} after load"
                assert torch.equal(rank_value(again[k], r), new[k]), f"rank {r}: round trip of {k!r}"


def _check_loaded_model_runs(sharded, model, plan, ranks, coord_of, mesh_shape) -> None:
    """After loading, the sharded forward equals the single-device model with the same
    weights (shows the loaded slices are where the graph expects them)."""
    with plain():
        model.load_state_dict(_modified(model.state_dict()))
        want = model(IDS)
    out = sharded(IDS if "tokens" not in plan.inputs else _batch_slices(plan, coord_of, mesh_shape))
    for r in ranks:
        with plain():
            exp = slice_for(want, {"dp": Shard(0)} if "tokens" in plan.inputs else {}, coord_of(r), mesh_shape)
            torch.testing.assert_close(rank_value(out, r), exp, atol=1e-5, rtol=1e-4)


def _batch_slices(plan, coord_of, mesh_shape):
    return rank_map(lambda r: slice_for(IDS, plan.inputs["tokens"], coord_of(r), mesh_shape).clone())


@pytest.mark.parametrize("case", range(len(_plans())), ids=[p[0] for p in _plans()])
def test_round_trip_simulated(case):
    name, make_model, mesh_shape, make_plan = _plans()[case]
    model = make_model()
    world = math.prod(mesh_shape.values())
    with simulated(mesh_shape) as mesh:
        plan = make_plan(mesh)
        sharded = fxshard.transform(model, plan, (IDS,))
        coord_of = functools.partial(coords_of, mesh_shape=mesh_shape)
        _check_round_trip(sharded, model, mesh_shape, range(world), coord_of)
        _check_loaded_model_runs(sharded, model, plan, range(world), coord_of, mesh_shape)


def test_load_rejects_wrong_keys_and_shapes():
    model = llama(n_heads=8, n_kv_heads=4)
    sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    sd = model.state_dict()
    with pytest.raises(KeyError, match="missing keys"):
        fxshard.load_full_state_dict(sharded, {k: v for k, v in sd.items() if k != "norm.weight"})
    with pytest.raises(ValueError, match="global shape"):
        fxshard.load_full_state_dict(sharded, {**sd, "layers.0.attention.wq.weight": torch.zeros(32, 64)})
    with pytest.raises(ValueError, match="not produced by fxshard.transform"):
        fxshard.full_state_dict(torch.fx.symbolic_trace(model))


def _real_round_trip(rank, world_size):
    for name, make_model, mesh_shape, make_plan in _plans():
        if math.prod(mesh_shape.values()) != world_size:
            continue
        mesh = make_mesh(mesh_shape)
        model = make_model()
        plan = make_plan(mesh)
        sharded = fxshard.transform(model, plan, (IDS,))
        coord = coords_of(rank, mesh_shape)
        _check_round_trip(sharded, model, mesh_shape, [rank], lambda r: coord)
        _check_loaded_model_runs(sharded, model, plan, [rank], lambda r: coord, mesh_shape)


def test_round_trip_real():
    """4 gloo ranks: tp=4 and dp=2 x tp=2."""
    spawn(_real_round_trip, 4)
