"""propagate: every value gets its layout, global and local shape; layouts change
only at declared boundaries; rewrites are flagged for the specialized passes."""
from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from equivalence import check_simulated
from fxshard import MeshSpec, Plan, PlanError, colwise, rowwise, vocab_parallel
from fxshard.markers import region_output
from fxshard.meta import KEY, SizeInfo, TensorInfo
from fxshard.testing.models import llama, llama_plan, mlp, tokens

IDS = tokens(2, 8, 128)
R = Replicate()


def _value(gm, pred, i=0):
    return [n for n in gm.graph.nodes if pred(n)][i].meta[KEY]


def test_llama_attention_layouts(after_pass):
    gm = after_pass("propagate", llama(n_heads=8, n_kv_heads=4), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    is_ = lambda target: (lambda n: n.target is target)
    q = _value(gm, is_(F.linear)).value
    assert q == TensorInfo({"tp": Shard(2)}, (2, 8, 64), (2, 8, 32), torch.float32, True)
    k = _value(gm, is_(F.linear), 1).value
    assert k.local_shape == (2, 8, 16) and k.shape == (2, 8, 32)
    view_q = _value(gm, lambda n: n.op == "call_method" and n.target == "view").value
    assert view_q.layout == {"tp": Shard(2)} and view_q.local_shape == (2, 8, 4, 8)  # 8 heads -> 4 per rank
    sdpa = _value(gm, is_(F.scaled_dot_product_attention)).value
    assert sdpa.layout == {"tp": Shard(1)} and sdpa.local_shape == (2, 4, 8, 8)
    wo = _value(gm, is_(F.linear), 3)
    assert wo.value.layout == {"tp": Partial()} and wo.rule == "linear"
    out = _value(gm, lambda n: n.target is region_output and n.args[1] == "layers.0.attention.wo")
    assert out.redistribute == ({"tp": Partial()}, {"tp": R}) and out.value.layout == {"tp": R}
    logits = _value(gm, is_(F.linear), -1).value
    assert logits.layout == {"tp": R} and logits.local_shape == logits.shape == (2, 8, 128)


def test_sizes_read_at_run_time(after_pass):
    gm = after_pass("propagate", llama(), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    import operator
    sizes = [n.meta[KEY].value for n in gm.graph.nodes if n.target is operator.getitem and isinstance(n.meta[KEY].value, SizeInfo)]
    assert SizeInfo(2, frozenset()) in sizes and SizeInfo(8, frozenset()) in sizes


def test_batch_sharding_flows_through(after_pass):
    plan = Plan(MeshSpec(("dp", "tp"), (2, 2)), llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}})
    gm = after_pass("propagate", llama(), plan, (tokens(4, 8, 128),))
    emb = _value(gm, lambda n: n.target is F.embedding).value
    assert emb.layout == {"dp": Shard(0), "tp": R} and emb.local_shape == (2, 8, 64)
    q = _value(gm, lambda n: n.target is F.linear).value
    assert q.layout == {"dp": Shard(0), "tp": Shard(2)} and q.local_shape == (2, 8, 32)


def test_propagate_adds_no_communication(before_pass, after_pass):
    plan = Plan(MeshSpec(("tp",), (2,)), llama_plan("tp"))
    model = llama()
    assert before_pass("propagate", model, plan, (IDS,)).code == after_pass("propagate", model, plan, (IDS,)).code


def test_rewrites_are_flagged(after_pass):
    x = torch.randn(2, 4, 32)
    gm = after_pass("propagate", mlp(), Plan(MeshSpec(("tp",), (2,)), {"fc2": rowwise(inputs=Replicate())}), (x,))
    assert [n.meta[KEY].rewrite for n in gm.graph.nodes if n.target is F.linear] == [None, "defer_bias"]
    plan = Plan(MeshSpec(("tp",), (2,)), {"tok_embeddings": vocab_parallel()})
    gm = after_pass("propagate", llama(), plan, (IDS,))
    emb = _value(gm, lambda n: n.target is F.embedding)
    assert emb.rewrite == "vocab_parallel_embedding" and emb.value.layout == {"tp": Partial()}


# ----------------------------------------------------------------------------- views of a fused projection


class GroupedQKV(torch.nn.Module):
    """Two linears around a fused projection viewed as groups.

    ``layout="grouped"`` is torchtitan's grouped fused QKV: out features ordered
    ``[n_kv][heads_per_kv + 2][hd]``, viewed ``(b, s, n_kv, heads_per_kv + 2, hd)`` and
    split ``[heads_per_kv, 1, 1]`` on the heads dim.  ``layout="parts"`` keeps q, k, v
    outermost: ``(b, s, 3, n_heads, hd)`` (timm's ViT attention).
    """

    def __init__(self, layout="grouped", dim=32, n_kv=2, heads_per_kv=2, hd=4):
        super().__init__()
        self.layout, self.n_kv, self.hpk, self.hd = layout, n_kv, heads_per_kv, hd
        self.n_heads = n_kv * heads_per_kv if layout == "grouped" else 4
        out = n_kv * (heads_per_kv + 2) * hd if layout == "grouped" else 3 * self.n_heads * hd
        self.wqkv = torch.nn.Linear(dim, out, bias=False)
        self.wo = torch.nn.Linear(self.n_heads * hd, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        if self.layout == "grouped":
            xqkv = self.wqkv(x).view(b, s, self.n_kv, self.hpk + 2, self.hd)
            q, k, v = xqkv.split([self.hpk, 1, 1], dim=-2)
            out = q * torch.sigmoid(k) + v  # [b, s, n_kv, heads_per_kv, hd]
        else:
            xqkv = self.wqkv(x).view(b, s, 3, self.n_heads, self.hd)
            q, k, v = xqkv[:, :, 0], xqkv[:, :, 1], xqkv[:, :, 2]
            out = q * torch.sigmoid(k) + v  # [b, s, n_heads, hd]
        return self.wo(out.reshape(b, s, self.n_heads * self.hd))


def _grouped(layout):
    torch.manual_seed(0)
    return GroupedQKV(layout)


XG = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(3))


def test_fused_splits_refused_on_a_grouped_view():
    """colwise(splits=[q, k, v]) gives each rank [q slice | k slice | v slice]: not a
    shard of torchtitan's grouped view; it used to be accepted (max diff 1.4)."""
    plan = Plan(MeshSpec(("tp",), (2,)), {"wqkv": colwise(splits=[16, 8, 8]), "wo": rowwise()})
    with pytest.raises(PlanError) as err:
        fxshard.transform(_grouped("grouped"), plan, (XG,))
    msg = str(err.value)
    for fragment in ("`view`", "module `wqkv`", "splits=[16, 8, 8]", "sharded on 'tp'", "not a contiguous shard",
                     "drop splits= from colwise('tp') of module `wqkv`", "separate projections", "xqkv = self.wqkv(x).view("):
        assert fragment in msg, f"{fragment!r} missing from:\n{msg}"


def test_grouped_view_without_splits_is_equal():
    """Plain colwise: each rank holds whole kv groups (the sharded view dim is n_kv)."""
    check_simulated(lambda: _grouped("grouped"), lambda mesh: Plan(mesh, {"wqkv": colwise(), "wo": rowwise()}), (XG,), {"tp": 2})


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_splits_with_parts_outermost_view_is_equal(tp, after_pass):
    """[b, s, 3*D] -> [b, s, 3, H, hd] keeps the parts outermost: each rank's slice of
    every part is a shard of the heads dim."""
    plan_factory = lambda mesh: Plan(mesh, {"wqkv": colwise(splits=[16, 16, 16]), "wo": rowwise()})
    check_simulated(lambda: _grouped("parts"), plan_factory, (XG,), {"tp": tp})
    gm = after_pass("propagate", _grouped("parts"), plan_factory(MeshSpec(("tp",), (tp,))), (XG,))
    view = _value(gm, lambda n: n.op == "call_method" and n.target == "view").value
    assert view.layout == {"tp": Shard(3)} and view.local_shape == (2, 3, 3, 4 // tp, 4)


# ----------------------------------------------------------------------------- traced Python numbers


class Scaled(torch.nn.Module):
    """``h (op) 1.0 / math.sqrt(h.size(d))``: a traced float, as nanoGPT's attention scale."""

    def __init__(self, op="mul", dim=-1):
        super().__init__()
        self.op, self.dim = op, dim
        self.fc1 = torch.nn.Linear(32, 64, bias=False)  # a Partial output with a bias could not be returned
        self.fc2 = torch.nn.Linear(64, 32)

    def forward(self, x):
        h = self.fc1(x)
        scale = 1.0 / math.sqrt(h.size(self.dim))
        h = h * scale if self.op == "mul" else (h / scale if self.op == "div" else h + scale)
        return self.fc2(h)


def _scaled(op="mul", dim=-1):
    torch.manual_seed(0)
    return Scaled(op, dim)


def _partial_fc1(mesh):
    """fc1 row-parallel, kept Partial on exit; fc2 all-reduces it on entry."""
    return Plan(mesh, {"fc1": rowwise(inputs=Replicate(), out=Partial()), "fc2": fxshard.ModuleSpec(inputs={"tp": Replicate()})})


def test_traced_float_gets_a_size_info_not_a_layout(after_pass):
    """Used to raise AttributeError: 'float' object has no attribute 'dim', even with an empty plan."""
    x = torch.randn(2, 4, 32)
    gm = after_pass("propagate", _scaled(), Plan(MeshSpec(("tp",), (2,)), {}), (x,))
    sqrt = _value(gm, lambda n: n.target is math.sqrt)
    assert sqrt.value == SizeInfo(8.0, frozenset())
    div = _value(gm, lambda n: n.target is operator.truediv)
    assert div.value == SizeInfo(1 / 8.0, frozenset())
    assert _value(gm, lambda n: n.target is operator.mul).value.layout == {"tp": R}


@pytest.mark.parametrize("op", ["mul", "div"])
def test_traced_scalar_times_partial_is_partial(op, after_pass):
    """Scaling is linear: a Partial times (or over) a traced scalar stays Partial, as with a literal."""
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(5))
    gm = after_pass("propagate", _scaled(op), _partial_fc1(MeshSpec(("tp",), (2,))), (x,))
    target = operator.mul if op == "mul" else operator.truediv
    scaled = _value(gm, lambda n: n.target is target and isinstance(n.meta[KEY].value, TensorInfo))
    assert scaled.value.layout == {"tp": Partial()}
    check_simulated(lambda: _scaled(op), _partial_fc1, (x,), {"tp": 2})


def test_traced_scalar_plus_partial_is_refused():
    with pytest.raises(PlanError) as err:
        fxshard.transform(_scaled("add"), _partial_fc1(MeshSpec(("tp",), (2,))), (torch.randn(2, 4, 32),))
    msg = str(err.value)
    assert "`add`" in msg and "not linear" in msg and "Partial" in msg and "axis 'tp'" in msg, msg


def test_scalar_from_a_sharded_size_is_refused():
    """``h.size(-1)`` of a column-parallel output is each rank's local size: the scale
    would differ from the single-device one."""
    plan = Plan(MeshSpec(("tp",), (2,)), {"fc1": colwise(), "fc2": rowwise()})
    with pytest.raises(PlanError) as err:
        fxshard.transform(_scaled("mul"), plan, (torch.randn(2, 4, 32),))
    msg = str(err.value)
    for fragment in ("`mul`", "operand `truediv`", "`size`, the size of a dim sharded on ['tp']", "local size", "literal"):
        assert fragment in msg, f"{fragment!r} missing from:\n{msg}"
    # a size of a dim that is not sharded is the same on every rank: equal
    check_simulated(lambda: _scaled("mul", dim=1), lambda mesh: Plan(mesh, {"fc1": colwise(), "fc2": rowwise()}),
                    (torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(6)),), {"tp": 2})


class Positions(torch.nn.Module):
    def forward(self, x):
        return x + torch.arange(x.size(1), dtype=x.dtype)[None, :, None]


class ShiftedPositions(torch.nn.Module):
    def forward(self, x):
        return x + torch.arange(x.size(1) + 1, dtype=x.dtype)[None, 1:, None]


def test_positions_from_a_sharded_size_are_this_ranks_own():
    """``torch.arange(x.size(1))`` of a sequence-sharded x: each rank builds the
    positions of its own shard (``Shard(0)``, plus the rank's offset); a size combined
    in a way fxshard cannot follow (``x.size(1) + 1``) is refused, not built wrong."""
    x = torch.randn(2, 8, 4)
    gm = check_simulated(Positions, lambda mesh: Plan(mesh, {}, inputs={"x": {"tp": Shard(1)}}), (x,), {"tp": 2}, steps=0)  # no parameters
    assert "fxshard_runtime_local_offset('tp', " in gm.code or "local_offset('tp', " in gm.code
    with pytest.raises(PlanError) as err:
        fxshard.transform(ShiftedPositions(), Plan(MeshSpec(("tp",), (2,)), {}, inputs={"x": {"tp": Shard(1)}}), (x,))
    msg = str(err.value)
    for fragment in ("`arange`", "sharded on ['tp']", "local size", "literal"):
        assert fragment in msg, f"{fragment!r} missing from:\n{msg}"
    gm = fxshard.transform(Positions(), Plan(MeshSpec(("tp",), (2,)), {}, inputs={"x": {"tp": Shard(0)}}), (x,))
    assert any(n.target is torch.arange for n in gm.graph.nodes)


class SliceAssign(nn.Module):
    """MLA-style key assembly: head-sharded parts and a replicated part broadcast over
    the heads are copied into slices of one buffer (``k[..., :2].copy_(...)``)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.rot = nn.Parameter(torch.randn(2))
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x).view(x.shape[0], x.shape[1], 4, 4)
        k = torch.zeros_like(h)
        k[..., :2].copy_(h[..., :2])
        k[..., 2:].copy_(self.rot)  # Replicate, broadcast along the sharded heads
        return self.down(k.flatten(2))


def test_copy_into_a_slice_of_a_sharded_buffer_is_equal():
    from equivalence import check_simulated
    from fxshard import rowwise

    check_simulated(SliceAssign, lambda mesh: Plan(mesh, {"up": colwise(), "down": rowwise()}), (torch.randn(2, 3, 8),), {"tp": 2})


class SliceAssignMismatch(SliceAssign):
    def forward(self, x):
        h = self.up(x).view(x.shape[0], x.shape[1], 4, 4)
        k = torch.zeros(x.shape[0], x.shape[1], 4, 4)  # Replicate: the sharded parts do not line up
        k[..., :2].copy_(h[..., :2])
        return self.down(k.flatten(2))


def test_copy_of_a_sharded_value_into_a_replicated_buffer_is_refused():
    from fxshard import rowwise, transform

    with pytest.raises(PlanError, match="copies a S\\(2\\) value into a R one"):
        transform(SliceAssignMismatch(), Plan(MeshSpec(("tp",), (2,)), {"up": colwise(), "down": rowwise()}), (torch.randn(2, 3, 8),))


def test_dim_sharded_over_two_axes_that_divide_it_only_one_at_a_time():
    """Regression (issue 15 fuzz): dim 0 of 6 divides dp=2 and tp=2 but not their
    product; this was a StopIteration reported as an internal error."""
    model = nn.Sequential(nn.Linear(4, 6))
    plan = Plan(MeshSpec(("dp", "tp"), (2, 2)), {"0": fxshard.ModuleSpec(params={"weight": {"dp": Shard(0), "tp": Shard(0)}})})
    with pytest.raises(PlanError, match=r"dim 0 of size 6 is sharded over axes \['dp', 'tp'\], whose sizes together \(4\)") as e:
        fxshard.transform(model, plan, example_inputs=(torch.randn(2, 4),))
    assert "internal error" not in str(e.value)


class _SumPlusMean(nn.Module):
    def forward(self, x):
        return x.sum(-1) + x.mean(-1)


def test_partial_sum_plus_partial_avg_is_refused():
    """Found in issue 15: a Partial(sum) plus a Partial(avg) took the layout of the
    first operand, so the all-reduce after it summed the mean's shares too."""
    plan = Plan(MeshSpec(("tp",), (2,)), {}, inputs={"x": {"tp": Shard(1)}})
    with pytest.raises(PlanError, match=r"combines Partial values that reduce differently \(avg, sum\)"):
        fxshard.transform(_SumPlusMean(), plan, example_inputs=(torch.randn(2, 4),))


class _FusedGathered(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(x)


def test_op_without_rule_taking_a_local_size_is_refused():
    """An op with no rule of its own that takes a size read from a sharded dim would get
    each rank's local size; nothing rescales it (found with ``torch.narrow``)."""
    class Roll(nn.Module):
        def forward(self, x):
            return torch.roll(x, x.size(1), 0)

    plan = Plan(MeshSpec(("tp",), (2,)), {}, inputs={"x": {"tp": Shard(1)}})
    with pytest.raises(PlanError, match=r"roll has no layout rule and takes `size`.*sharded on \['tp'\]"):
        fxshard.transform(Roll(), plan, example_inputs=(torch.randn(4, 8),))


def test_gathering_a_fused_projection_output_is_refused():
    """Regression (issue 15 fuzz): ``colwise(splits=[4, 4], out=Replicate())`` all-gathered
    [r0 part0 | r0 part1 | r1 part0 | ...], the parts' slices out of order (max diff 0.03)."""
    plan = Plan(MeshSpec(("tp",), (4,)), {"head": colwise(out=R, splits=[4, 4])})
    with pytest.raises(PlanError, match=r"fused projection \(splits=\[4, 4\]\) is sharded part by part"):
        fxshard.transform(_FusedGathered(), plan, example_inputs=(torch.randn(2, 8),))


def test_fused_output_read_as_a_contiguous_shard_is_refused():
    """Regression (issue 15 fuzz): ``colwise(splits=[4, 4])`` -> relu -> ``rowwise()``: the
    row-parallel weight's contiguous Shard(1) did not line up with the part-by-part
    activation (max diff 0.9).  Elementwise ops carry the parts; the linear refuses."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    plan = Plan(MeshSpec(("tp",), (2,)), {"0": colwise(splits=[4, 4]), "2": rowwise()})
    with pytest.raises(PlanError, match=r"output of a fused projection \(splits=\[4, 4\]\).*this op would read it as one"):
        fxshard.transform(model, plan, example_inputs=(torch.randn(2, 4),))


class _Einsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.w1(x).unflatten(-1, (4, 4))
        a, b = h.unflatten(-1, (2, 2)).unbind(-2)
        h = torch.einsum("bsgf,bsgf->bsgf", a, b).repeat_interleave(2, -1)
        return self.w2(h.flatten(-2))


def test_ops_whose_decomposition_reads_the_device_get_dtensor_layouts():
    """Regression (issue 15 fuzz): einsum and unbind decompose through ``prim.device``,
    which has no DTensor strategy; the query was refused, now it is skipped."""
    plan = lambda mesh: Plan(mesh, {"w1": colwise(), "w2": rowwise()})
    check_simulated(_Einsum, plan, (torch.randn(2, 3, 8),), {"tp": 2}, steps=1)


def test_llama_exports_with_its_own_plan():
    """Regression (issue 15 fuzz): under capture="export" GQA's aten.repeat_interleave on
    head-sharded k/v was refused (``prim.device`` in its decomposition)."""
    model = llama(seed=0, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, vocab_size=32, ffn_hidden=32)
    gm = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), example_inputs=(tokens(2, 8, 32),),
                           capture="export")
    assert any(n.target is fxshard.all_reduce for n in gm.graph.nodes)


class _ArangePositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(8, 4)

    def forward(self, x):
        return x + self.pos(torch.arange(x.size(1), device=x.device))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_factory_sized_by_a_local_size_gives_this_ranks_positions_under_both_captures(capture):
    """Regression (issue 15 fuzz): exported graphs held ``aten.arange``, which skipped the
    factory rule's check and built the first positions on every rank (max diff 2.4).
    Both captures now build the rank's own positions (the embedding's weight gradient
    is then summed over the ranks)."""
    plan = lambda mesh: Plan(mesh, {"pos": fxshard.ModuleSpec(out_dst={"tp": Shard(0)})}, inputs={"x": {"tp": Shard(1)}})
    x = torch.randn(2, 4, 4)
    check_simulated(_ArangePositions, plan, (x,), {"tp": 2}, example_inputs=(x,), name=f"arange positions {capture}")
    gm = fxshard.transform(_ArangePositions(), plan(MeshSpec(("tp",), (2,))), example_inputs=(x,), capture=capture,
                           stop_after="propagate")  # localize acts on the request, and clears it
    assert any(n.target is torch.arange and n.meta[KEY].rewrite == "arange_offset" for n in gm.graph.nodes)


class _EinsumScores(nn.Module):
    """Attention scores by einsum on head-sharded q/k (DTensor's decomposition passes
    through a _StridedShard view), the rest by matmul."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (w(x).view(B, S, 4, 4) for w in (self.wq, self.wk, self.wv))
        p = torch.einsum("bshd,bthd->bhst", q, k).mul(0.5).softmax(-1)
        return self.wo((p @ v.transpose(1, 2)).transpose(1, 2).reshape(B, S, 16))


def test_dtensor_intermediates_fxshard_does_not_represent_are_allowed():
    """Found by the fuzz (issue 15): einsum attention on head-sharded q/k was refused
    because an intermediate of its decomposition is a _StridedShard; only the node's
    own outputs must be layouts fxshard represents."""
    plan = lambda mesh: Plan(mesh, {"wq": colwise(), "wk": colwise(), "wv": colwise(), "wo": rowwise()})
    check_simulated(_EinsumScores, plan, (torch.randn(2, 4, 16),), {"tp": 2}, steps=1)
