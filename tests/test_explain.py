"""fxshard.explain: the chain of rules and plan entries behind a node's layout.

Nodes are found by what they are (the linear whose weight is ``layers.0.feed_forward.w2``),
not by generated names, and the expected plan entries come from the plan itself.
"""
from __future__ import annotations

import pytest
import operator

import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import MeshSpec, Plan
from fxshard.debug.explain import explain
from fxshard.meta import KEY, SizeInfo
from fxshard.testing.models import WithLoss, gpt2, gpt2_plan, llama, llama_plan, tokens


@pytest.fixture(scope="module")
def llama_tp2():
    model = llama(n_heads=8, n_kv_heads=4)
    return fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (tokens(2, 8, 128),))


def _linear_of(gm, weight: str):
    """The linear whose weight is parameter ``weight`` (possibly through a grad sync)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch._C._nn.linear:
            w = n.args[1]
            while w.op != "get_attr" and (w.meta[KEY].collective is not None or w.target is operator.getitem):
                w = w.args[0].args[0][w.args[1]] if w.target is operator.getitem else w.args[0]  # through a bucket
            if w.target == weight:
                return n
    raise AssertionError(f"no linear with weight {weight}")


def _tree(text: str, axis: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(next(l for l in lines if l.startswith(f"{axis}=") and l.endswith("because:")))
    out = []
    for line in lines[start + 1:]:
        if not line:
            break
        out.append(line)
    return out


def test_row_parallel_output_goes_back_to_the_sharded_weights(llama_tp2):
    node = _linear_of(llama_tp2, "layers.0.feed_forward.w2.weight")
    text = explain(llama_tp2, node.name)
    tree = _tree(text, "tp")
    assert tree[0].startswith(f"{node.name}  P  rule `linear`")
    # every sharded weight that feeds it is reached, each with its plan entry and param name
    for w, p in (("w1", "Shard(0)"), ("w3", "Shard(0)"), ("w2", "Shard(1)")):
        entry = f"layers.*.feed_forward.{w}"
        assert llama_plan("tp")[entry].params["weight"]["tp"] == eval(p)  # the plan says so
        assert any(f"plan entry {entry!r} params['weight']" in l and "declared" in l for l in tree), (w, text)
    # the replicated input of w1/w3 carries no sharding: it is named, not followed
    assert not any("rms_norm" in l.split()[1] for l in tree if len(l.split()) > 1 and l.lstrip("|+-` ").startswith("rms_norm"))
    assert "module:  layers.0.feed_forward.w2  (plan entry 'layers.*.feed_forward.w2')" in text


def test_collective_is_a_declared_boundary(llama_tp2):
    node = next(n for n in llama_tp2.graph.nodes if n.meta[KEY].collective is not None
                and n.meta[KEY].collective.op == "all_reduce" and n.meta[KEY].region == "layers.1.attention.wo")
    tree = _tree(explain(llama_tp2, node), "tp")
    assert len(tree) == 1  # stops at the boundary
    assert "declared: plan boundary (output 'output' of layers.1.attention.wo, plan entry 'layers.*.attention.wo')" in tree[0]
    assert f"turns {node.args[0].name} P into R" in tree[0]


def test_replicated_value_reaches_inputs_and_boundaries(llama_tp2):
    # the residual after layer 0: embedding + two all-reduces
    add = next(n for n in llama_tp2.graph.nodes if n.meta.get("nn_module_stack") and n.target is __import__("operator").add
               and n.meta[KEY].region is None and any(a.meta[KEY].collective is not None
                                                      and a.meta[KEY].region == "layers.0.feed_forward.w2" for a in n.args))
    text = explain(llama_tp2, add.name)
    assert "declared: graph input 'tokens', replicated" in text
    assert "parameter 'tok_embeddings.weight', replicated (no plan entry names it)" in text
    assert text.count("declared: plan boundary") == 2


def test_grad_sync_is_walked_through(llama_tp2):
    gs = next(n for n in llama_tp2.graph.nodes if n.meta[KEY].collective is not None and n.meta[KEY].collective.op == "grad_sync")
    tree = _tree(explain(llama_tp2, gs.name), "tp")
    assert "grad sync: identity forward, all-reduces the gradient (layout unchanged)" in tree[0]
    assert tree[1].lstrip("`+- ").startswith(gs.args[0].name)


def test_two_axes_each_explained():
    model = llama(n_heads=8, n_kv_heads=4, n_layers=1)
    mesh = MeshSpec(("dp", "tp"), (2, 2))
    gm = fxshard.transform(model, Plan(mesh, llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}}), (tokens(2, 8, 128),))
    node = _linear_of(gm, "layers.0.attention.wq.weight")
    text = explain(gm, node.name)
    dp, tp = _tree(text, "dp"), _tree(text, "tp")
    assert dp[0].startswith(f"{node.name}  S(0)") and tp[0].startswith(f"{node.name}  S(2)")
    assert any("declared: graph input 'tokens', Plan(inputs=" in l for l in dp)
    assert not any("layers.*.attention.wq" in l for l in dp)  # the weight is replicated on dp
    assert any("plan entry 'layers.*.attention.wq' params['weight']" in l for l in tp)
    only_tp = explain(gm, node.name, axis="tp")
    assert "dp=S(0) because" not in only_tp and "tp=S(2) because" in only_tp
    with pytest.raises(ValueError, match="axis 'ep' is not on the mesh"):
        explain(gm, node.name, axis="ep")


def test_sequence_parallel_boundary():
    model = WithLoss(gpt2())
    plan = {f"model.{k}": v for k, v in gpt2_plan("tp", sequence_parallel=True, loss_parallel=True).items()}
    ids = tokens(2, 8, 128)
    gm = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), plan), (ids, tokens(2, 8, 128, seed=1)))
    ln = next(n for n in gm.graph.nodes if n.target is torch.nn.functional.layer_norm and n.meta[KEY].region == "model.h.1.ln_1")
    tree = _tree(explain(gm, ln), "tp")
    assert tree[0].startswith(f"{ln.name}  S(1)")
    # the sequence sharding comes from the reduce-scatter that ends block 0's MLP
    assert any("declared: plan boundary" in l and "reduce_scatter" in l and "model.h.0.mlp.c_proj" in l for l in tree), tree


def test_ints_errors_and_depth(llama_tp2):
    size = next(n for n in llama_tp2.graph.nodes if isinstance(n.meta[KEY].value, SizeInfo))
    assert "not a tensor" in explain(llama_tp2, size.name)
    out = next(n for n in llama_tp2.graph.nodes if n.op == "output")
    assert "the graph output; it returns" in explain(llama_tp2, out.name)
    with pytest.raises(ValueError, match=r"no node 'linaer_3'; did you mean \[.*'linear_3'"):
        explain(llama_tp2, "linaer_3")
    node = _linear_of(llama_tp2, "layers.0.feed_forward.w2.weight")
    short = explain(llama_tp2, node, max_depth=1)
    assert "... (continue with fxshard.explain(gm, " in short
    assert len(short.splitlines()) < len(explain(llama_tp2, node).splitlines())


def test_regions_records_the_plan_entry(llama_tp2):
    """``extra["pattern"]`` (written by the regions pass): the entry that declared a
    parameter, and the entry of the module a node is in."""
    for n in llama_tp2.graph.nodes:
        pattern = n.meta[KEY].extra.get("pattern")
        if n.op == "get_attr" and n.target.endswith("attention.wq.weight"):
            assert pattern == "layers.*.attention.wq"
        if n.op == "get_attr" and n.target.endswith("norm.weight"):
            assert pattern is None
