"""Inputs cut by hand into unequal pieces where the program assumes equal ones.

A program transformed at sequence 16 with the sequence sharded over an axis (context
parallel on ``cp``, sequence parallel on ``tp``) computes each rank's positions as its
index times its own length and exchanges the pieces as equal ones.  Called with a user's
own pieces of 8 and 7 (``ids.chunk(2, 1)`` of 15 tokens), it computed wrong positions or
aborted inside gloo; now every rank raises the same PlanError before any collective of
the model, and equal pieces of another length still give the single-device numbers.
"""
import pytest
import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import Plan, PlanError
from fxshard.testing.models import llama, llama_plan, tokens
from harness import make_mesh, plain, rank_map, simulated, spawn

V = 128


def _plan(kind, mesh):
    if kind == "cp":
        return Plan(mesh, {"layers.*.attention": fxshard.context_parallel("cp", method="allgather", load_balance=False)},
                    inputs={"tokens": {"cp": Shard(1)}})
    if kind == "ring":
        return Plan(mesh, {"layers.*.attention": fxshard.context_parallel("cp", method="ring", load_balance=False)},
                    inputs={"tokens": {"cp": Shard(1)}})
    if kind == "dp-cp":
        return Plan(mesh, {"layers.*.attention": fxshard.context_parallel("cp", method="allgather", load_balance=False)},
                    inputs={"tokens": {"dp": Shard(0), "cp": Shard(1)}})
    return Plan(mesh, llama_plan("tp", sequence_parallel=True), inputs={"tokens": {"tp": Shard(1)}})


def _refused_then_exact(rank, world_size):
    for kind in ("cp", "ring", "tp"):
        axis = "tp" if kind == "tp" else "cp"
        mesh = make_mesh({axis: 2})
        model = llama()
        sharded = fxshard.transform(model, _plan(kind, mesh), (tokens(2, 16, V, seed=3),))
        ids = tokens(2, 15, V)
        with pytest.raises(PlanError, match=rf"(?s)input 'tokens'.*has {8 - rank} on dim 1 on this rank, and the ranks of "
                                            rf"axis '{axis}' hold 7 to 8.*transformed at 16.*fix: pad dim 1 to a multiple of 2"):
            sharded(ids.chunk(2, 1)[rank])
        ids = tokens(2, 14, V)  # equal pieces of another length than the example's: the single-device numbers
        out = sharded(ids.chunk(2, 1)[rank])
        ref = model(ids).detach()
        ref = ref if out.shape[1] == 14 else ref.chunk(2, 1)[rank]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_unequal_pieces_refused_on_every_rank_real_gloo():
    spawn(_refused_then_exact, 2)


def _other_group_unequal(rank, world_size):
    """dp x cp on 4 ranks: only the cp group of dp=1 holds unequal pieces; the dp=0 group,
    whose own pieces are equal, raises too (it would wait in the backward's dp sync)."""
    mesh = make_mesh({"dp": 2, "cp": 2})
    sharded = fxshard.transform(llama(), _plan("dp-cp", mesh), (tokens(4, 16, V, seed=3),))
    dp, cp = divmod(rank, 2)
    ids = tokens(2, 16 if dp == 0 else 15, V, seed=dp)
    with pytest.raises(PlanError, match="(hold 7 to 8|elsewhere on the mesh hold unequal pieces)"):
        sharded(ids.chunk(2, 1)[cp])


def test_unequal_pieces_in_another_group_refused_everywhere_real_gloo():
    spawn(_other_group_unequal, 4)


def test_unequal_pieces_refused_simulated():
    with simulated({"cp": 2}) as mesh:
        with plain():
            model, example, ids = llama(), tokens(2, 16, V, seed=3), tokens(2, 15, V)
        sharded = fxshard.transform(model, _plan("cp", mesh), (example,))
        with pytest.raises(PlanError, match="the ranks of axis 'cp' hold 7 to 8"):
            sharded(rank_map(lambda r: ids.chunk(2, 1)[r].clone()))


def test_only_where_equal_pieces_are_assumed():
    """A data-parallel axis may hold unequal rows (no guard); an example length the axis does
    not divide leaves the pieces' lengths to the program."""
    from fxshard import MeshSpec
    from fxshard.training.batch import EqualPiecesGuard, equal_pieces

    dp = fxshard.transform(llama(), Plan(MeshSpec(("dp",), (2,)), {}, inputs={"tokens": {"dp": Shard(0)}}),
                           (tokens(4, 16, V),))
    assert equal_pieces(dp) == [] and not any(isinstance(h, EqualPiecesGuard) for h in dp._forward_pre_hooks.values())
    cp = fxshard.transform(llama(), _plan("cp", MeshSpec(("cp",), (2,))), (tokens(2, 16, V),))
    assert [(p.name, p.dim, p.axis, p.size) for p in equal_pieces(cp)] == [("tokens", 1, "cp", 16)]
    assert any(isinstance(h, EqualPiecesGuard) for h in cp._forward_pre_hooks.values())
