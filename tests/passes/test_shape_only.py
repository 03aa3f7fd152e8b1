"""Values used only for their shape, dtype or device need no layout, only the right
local shape.  nanoGPT variants build the causal mask from the head-sharded scores,
``torch.ones_like(att[0, 0], dtype=torch.bool).tril()``: ``att[0, 0]`` selects the
sharded head dim away, so every rank's ``[T, T]`` has the global shape and the mask is
Replicate.  Where the measured value keeps a sharded dim (``att[0]``, the batch under
data parallelism), the ``*_like`` result is sharded like it.  Either way the sharded
program equals the single-device one."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from equivalence import Case, check_real_cases, check_simulated
from fxshard import MeshSpec, Plan, PlanError, colwise, rowwise
from fxshard.meta import KEY, program_meta

C, H, T = 32, 4, 8


class MaskedAttention(nn.Module):
    """nanoGPT's manual attention (fused ``c_attn`` split in three), its causal mask
    built by ``form`` from the scores themselves."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        B, T_, _ = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T_, H, C // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = self.masked(att)
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T_, C))

    def masked(self, att):
        if self.form == "every_other_form":
            for form in OTHER_FORMS:
                att = self.masked_by(att, form)
            return att
        return self.masked_by(att, self.form)

    def masked_by(self, att, form):
        if form == "ones_like":  # nanoGPT variants: the sharded head dim selected away
            return att.masked_fill(~torch.ones_like(att[0, 0], dtype=torch.bool).tril(), float("-inf"))
        if form == "keeps_heads":  # [H, T, T]: the measured value keeps the sharded dim
            return att.masked_fill(~torch.ones_like(att[0], dtype=torch.bool).tril(), float("-inf"))
        if form == "keeps_batch":  # [B, T, T]: batch kept (sharded on dp), heads selected away
            mask = torch.ones_like(att[:, 0], dtype=torch.bool).tril()
            return att.masked_fill(~mask[:, None], float("-inf"))
        if form == "full_like":
            return att + torch.full_like(att[0, 0], float("-inf")).triu(1)
        if form == "zeros_like":
            return att.masked_fill(torch.zeros_like(att[0, 0]).bool().logical_not().tril().logical_not(), float("-inf"))
        if form == "empty_like":
            return att.masked_fill(~torch.empty_like(att[0, 0], dtype=torch.bool).fill_(True).tril(), float("-inf"))
        if form == "rand_like":  # random numbers, all below 2: only the shape matters
            return att.masked_fill(~(torch.rand_like(att[0, 0]) < 2).tril(), float("-inf"))
        if form == "new_ones":
            scores = att[0, 0]
            return att.masked_fill(~scores.new_ones(scores.shape, dtype=torch.bool).tril(), float("-inf"))
        if form == "size_dtype_device":
            n = att[0, 0].size(-1)
            ones = torch.ones((n, n), dtype=att[0, 0].dtype, device=att[0, 0].device)
            return att.masked_fill(ones.tril() == 0, float("-inf"))
        if form == "view_of_selected":  # through a view of the selected value
            return att.masked_fill(~torch.ones_like(att[0, 0].reshape(T, T), dtype=torch.bool).tril(), float("-inf"))
        raise ValueError(form)


def make_model(form: str):
    torch.manual_seed(0)
    return MaskedAttention(form)


def make_plan(mesh):
    return Plan(mesh, {"c_attn": colwise(splits=[C] * 3), "c_proj": rowwise()})


def make_dp_plan(mesh):
    return Plan(mesh, {"c_attn": colwise(splits=[C] * 3), "c_proj": rowwise()}, inputs={"x": {"dp": Shard(0)}})


X = torch.randn(2, T, C, generator=torch.Generator().manual_seed(5))
X4 = torch.randn(4, T, C, generator=torch.Generator().manual_seed(6))


def _factory(form):
    import functools

    return functools.partial(make_model, form)


# each applies the same causal mask, so applied one after the other they still do
OTHER_FORMS = ["full_like", "zeros_like", "empty_like", "rand_like", "new_ones", "size_dtype_device", "view_of_selected"]


def test_nanogpt_mask_selects_the_sharded_dim_away_and_is_replicate():
    sharded = check_simulated(_factory("ones_like"), make_plan, (X,), {"tp": 2})
    ones = next(n for n in sharded.graph.nodes if n.target is torch.ones_like)
    assert ones.meta[KEY].value.layout == {"tp": Replicate()} and ones.meta[KEY].value.local_shape == (T, T)
    assert ones.args[0].meta[KEY].rule == "getitem: only its shape is read"


def test_a_measured_value_keeping_the_sharded_dim_gives_a_sharded_mask():
    sharded = check_simulated(_factory("keeps_heads"), make_plan, (X,), {"tp": 2})
    ones = next(n for n in sharded.graph.nodes if n.target is torch.ones_like)
    assert ones.meta[KEY].value.layout == {"tp": Shard(0)} and ones.meta[KEY].value.local_shape == (H // 2, T, T)


def _exported(form):
    import fxshard

    return fxshard.trace(make_model(form), make_plan(MeshSpec(("tp",), (2,))), (X,), capture="export")


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_every_other_measured_form_simulated(capture):
    """torch.export records the ``*_like`` and ``tril`` as aten ops and indexing as selects."""
    import functools

    factory = _factory("every_other_form") if capture == "fx" else functools.partial(_exported, "every_other_form")
    sharded = check_simulated(factory, make_plan, (X,), {"tp": 2})
    assert program_meta(sharded).captured_by == ("torch.fx" if capture == "fx" else "torch.export")


def test_batch_kept_heads_selected_away_on_a_dp_tp_mesh():
    sharded = check_simulated(_factory("keeps_batch"), make_dp_plan, (X4,), {"dp": 2, "tp": 2})
    ones = next(n for n in sharded.graph.nodes if n.target is torch.ones_like)
    assert ones.meta[KEY].value.layout == {"dp": Shard(0), "tp": Replicate()}
    assert ones.meta[KEY].value.local_shape == (2, T, T)


def test_real_gloo():
    check_real_cases(2, [Case(_factory("ones_like"), make_plan, (X,), {"tp": 2}, name="ones_like(att[0, 0])"),
                         Case(_factory("keeps_heads"), make_plan, (X,), {"tp": 2}, name="ones_like(att[0]), heads kept")])


class Refused(MaskedAttention):
    def masked(self, att):
        if self.form == "slice":  # 3 of 4 heads: each rank holds 2, so its local slice has 2, not 3
            return att + torch.zeros_like(att[0, :3]).sum(0)
        if self.form == "numbers":  # the numbers of att[0, 0] are read: refused as before
            return att + att[0, 0]
        raise ValueError(self.form)


@pytest.mark.parametrize("form", ["slice", "numbers"])
def test_what_is_not_only_measured_or_changes_the_local_shape_is_refused(form):
    import fxshard

    with pytest.raises(PlanError, match="sharded on 'tp'"):
        fxshard.transform(Refused(form), make_plan(MeshSpec(("tp",), (2,))), example_inputs=(X,))
