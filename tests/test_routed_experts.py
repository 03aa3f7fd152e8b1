"""fxshard.routed_experts: the preset's layouts, the routing each ep rank sees, the check
that runs the experts on their shards, and the PlanErrors of wrong uses (the model untouched)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard import MeshSpec, Plan, PlanError, routed_experts
from fxshard.layout.placements import DimBlocks
from fxshard.runtime.routed_experts import local_routing, sharding_error


class Experts(nn.Module):
    """HF's routed-experts convention, written out: ``experts(hidden, top_k_index,
    top_k_weights)``, weights stacked per expert, the sentinel ``num_experts`` skipped."""

    def __init__(self, n_experts=4, hidden=8, width=6, interleaved=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.num_experts = n_experts
        self.interleaved = interleaved
        self.gate_up_proj = nn.Parameter(torch.randn(n_experts, 2 * width, hidden, generator=g) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(n_experts, hidden, width, generator=g) * 0.3)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            gate_up = F.linear(hidden_states[token], self.gate_up_proj[e])
            gate, up = (gate_up[:, ::2], gate_up[:, 1::2]) if self.interleaved else gate_up.chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class Block(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = Experts(**kw)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        w, idx = torch.topk(F.softmax(self.gate(h), dim=-1), 2, dim=-1)
        return self.experts(h, idx, w).view_as(x)


EXAMPLE = [torch.zeros(8, 8), torch.zeros(8, 2, dtype=torch.long), torch.zeros(8, 2)]
X = torch.randn(2, 4, 8)


def test_layouts_and_packed_parts():
    spec = routed_experts(ep="ep", tp="tp")
    layouts, owners = spec.region_layouts(Experts(), "experts", {"ep": 2, "tp": 2})
    assert layouts == {"gate_up_proj": {"ep": Shard(0), "tp": Shard(1)}, "down_proj": {"ep": Shard(0), "tp": Shard(2)}}
    assert owners == {} and spec.region_blocks(Experts(), "experts", {"ep": 2, "tp": 2}) == {"gate_up_proj": DimBlocks(1, (6, 6))}
    assert spec.out_src == {"ep": Partial(), "tp": Partial()} and spec.out_dst == {"ep": Replicate(), "tp": Replicate()}


def test_local_routing_points_other_ranks_experts_at_the_sentinel():
    from harness import rank_value, simulated

    idx, w = torch.tensor([[3, 0], [2, 1]]), torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    with simulated({"ep": 2}) as mesh:
        fxshard.bind_mesh(mesh)
        local, lw = local_routing(idx, w, "ep", 2)
        assert rank_value(local, 0).tolist() == [[2, 0], [2, 1]] and rank_value(lw, 0).tolist() == [[0.0, 0.25], [0.0, 0.5]]
        assert rank_value(local, 1).tolist() == [[1, 2], [0, 2]] and rank_value(lw, 1).tolist() == [[0.75, 0.0], [0.5, 0.0]]


def test_the_check_accepts_the_right_sharding_and_catches_wrong_ones():
    assert sharding_error(Experts(), routed_experts(ep="ep", tp="tp"), {"ep": 2, "tp": 2}, EXAMPLE) is None
    # gate | up split in the middle: one rank holds all of gate
    why = sharding_error(Experts(), routed_experts(tp="tp", tp_dims={"gate_up_proj": (1, 1), "down_proj": (2, 1)}),
                         {"tp": 2}, EXAMPLE)
    assert why is not None and "add up to" in why
    # interleaved gate/up (gpt-oss): cut contiguously, not as two parts
    assert sharding_error(Experts(interleaved=True), routed_experts(tp="tp"), {"tp": 2}, EXAMPLE) is not None
    assert sharding_error(Experts(interleaved=True), routed_experts(tp="tp", tp_dims={"gate_up_proj": (1, 1), "down_proj": (2, 1)}),
                          {"tp": 2}, EXAMPLE) is None


def test_fx_traced_block_with_routed_experts_is_exact():
    from equivalence import check_simulated

    check_simulated(Block, lambda mesh: Plan(mesh, {"experts": routed_experts(tp="tp")}), (X,), {"tp": 2})


@pytest.mark.parametrize("spec, axes, match", [
    (routed_experts(ep="ep"), {"ep": 3}, r"4 experts cannot be split evenly over axis 'ep' of size 3"),
    (routed_experts(tp="tp"), {"tp": 4}, r"dim 1 of gate_up_proj \(4, 12, 8\) is 2 part\(s\) of 6, which axis 'tp' of size 4"),
    (routed_experts(tp="tp", tp_dims={"down_proj": (2, 1)}), {"tp": 2}, r"does not know how to shard gate_up_proj"),
    (routed_experts(ep="ep"), {"tp": 2}, r"axis 'ep' is not on the mesh"),
])
def test_wrong_plans_are_plan_errors(spec, axes, match):
    with pytest.raises(PlanError, match=match):
        spec.region_layouts(Experts(), "model.layers.0.mlp.experts", axes)


def test_wrong_uses_name_the_module_and_leave_the_model_alone():
    with pytest.raises(PlanError, match="name the axis"):
        routed_experts()
    with pytest.raises(PlanError, match="must differ"):
        routed_experts(ep="x", tp="x")
    with pytest.raises(PlanError, match=r"tokens=Shard\(dim=0\).*with ep="):
        routed_experts(tp="tp", tokens=Shard(0))
    block = Block(interleaved=True)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    with pytest.raises(PlanError, match=r"routed_experts on 'experts'.*add up to.*tp_dims="):
        fxshard.transform(block, Plan(MeshSpec(("tp",), (2,)), {"experts": routed_experts(tp="tp")}), (X,))
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())
    assert type(block.experts) is Experts and "forward" not in vars(block.experts)


def test_bias_of_a_rowwise_weight_is_refused():
    experts = Experts()
    experts.down_proj_bias = nn.Parameter(torch.zeros(4, 8))
    with pytest.raises(PlanError, match=r"down_proj_bias is the bias of down_proj.*add the whole bias"):
        routed_experts(tp="tp").region_layouts(experts, "experts", {"tp": 2})
