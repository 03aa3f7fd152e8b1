"""localize: literal sizes of sharded dims become local sizes; sizes read at run time
stay symbolic (and must come from a dim sharded the same way)."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from fxshard import MeshSpec, Plan, PlanError, colwise
from fxshard.models import llama, llama_plan, tokens

IDS = tokens(2, 8, 128)


def _sizes(gm, method):
    return [n.args[1:] for n in gm.graph.nodes if n.op == "call_method" and n.target == method]


def _literals(args):
    return tuple(a if not isinstance(a, fx.Node) else "run-time" for a in args)


@pytest.mark.parametrize("tp", [2, 4])
def test_head_counts_become_local(tp, before_pass, after_pass):
    model, plan = llama(n_heads=8, n_kv_heads=4), Plan(MeshSpec(("tp",), (tp,)), llama_plan("tp"))
    before = [_literals(a) for a in _sizes(before_pass("localize", model, plan, (IDS,)), "view")]
    after = [_literals(a) for a in _sizes(after_pass("localize", model, plan, (IDS,)), "view")]
    # q, k, v views of layer 0: (bsz, seqlen, heads, head_dim), bsz/seqlen read at run time
    assert before[:3] == [("run-time", "run-time", 8, 8), ("run-time", "run-time", 4, 8), ("run-time", "run-time", 4, 8)]
    assert after[:3] == [("run-time", "run-time", 8 // tp, 8), ("run-time", "run-time", 4 // tp, 8),
                         ("run-time", "run-time", 4 // tp, 8)]
    # the rope table view (replicated) keeps its sizes
    assert (1, "run-time", 1, 4) in after


def test_minus_one_is_left_to_infer(after_pass):
    gm = after_pass("localize", llama(n_heads=8, n_kv_heads=4), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    reshapes = [_literals(a) for a in _sizes(gm, "reshape")]
    assert ("run-time", "run-time", 4, -1, 2) in reshapes  # complex rope of q: 8 heads -> 4, -1 untouched


class Widen(nn.Module):
    """Views a column-parallel output with a size read from a replicated tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return self.fc(x).view(x.shape[0], x.shape[1], x.shape[2], 2)


def test_run_time_size_of_a_differently_sharded_dim():
    import fxshard

    with pytest.raises(PlanError) as err:
        fxshard.transform(Widen(), Plan(MeshSpec(("tp",), (2,)), {"fc": colwise()}), (torch.randn(2, 3, 8),))
    msg = str(err.value)
    assert "dim 2 is sized by" in msg and "sharded on ['tp']" in msg and "size that dim with a literal" in msg
