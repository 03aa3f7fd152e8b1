"""Plan.from_torch (fxshard.plan.importers.torch_plan): every field of every torch ParallelStyle
translated or refused by name; inert subclasses read as their base, behaviour-changing
ones refused; mixed positional and keyword input layouts; and on real gloo ranks the
imported plan gives what parallelize_module (DTensor) gives with the same plan."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
    SequenceParallel, parallelize_module)

import fxshard
from fxshard import MeshSpec, ModuleSpec, Plan, PlanError, colwise, rowwise, sequence_parallel
from fxshard.plan.importers.torch_plan import style_to_spec

from equivalence import Case, check_real_cases, expected_local

TP2 = MeshSpec(("tp",), (2,))
R = Replicate()
TP_R, TP_S1 = {"tp": R}, {"tp": Shard(1)}


# ----------------------------------------------------------------------------- styles and fields


@pytest.mark.parametrize("local", [True, False], ids=["local_output", "dtensor_output"])
def test_colwise_and_rowwise_fields(local):
    """input_layouts and output_layouts become inputs=/out=; use_local_output either way
    gives the same spec (fxshard carries every value's layout, as a DTensor does)."""
    c = style_to_spec(ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=local), "tp")
    assert c == colwise("tp", inputs=Shard(1), out=Replicate())
    r = style_to_spec(RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=local), "tp")
    assert r == rowwise("tp", inputs=Replicate(), out=Shard(1))
    assert style_to_spec(ColwiseParallel(), "tp") == colwise("tp") and style_to_spec(RowwiseParallel(), "tp") == rowwise("tp")


def test_loss_parallel_head():
    """torch's loss-parallel convention: a vocab-sharded DTensor out of the LM head."""
    spec = style_to_spec(ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False), "tp")
    assert spec.in_src == TP_S1 and spec.out_dst == {"tp": Shard(-1)}


def test_sequence_parallel_fields():
    assert style_to_spec(SequenceParallel(), "tp") == sequence_parallel("tp", dim=1)
    assert style_to_spec(SequenceParallel(sequence_dim=0, use_local_output=True), "tp") == sequence_parallel("tp", dim=0)
    bad = SequenceParallel()
    bad.sequence_sharding = (Replicate(),)
    with pytest.raises(PlanError, match=r"entry 'n'.*Shard\(sequence_dim\)"):
        Plan.from_torch(TP2, {"n": bad})


def test_prepare_module_input_positional_keyword_and_mixed():
    pos = style_to_spec(PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)), "tp")
    assert pos.inputs == (TP_R, None) and pos.in_src == (TP_S1, None)
    kw = style_to_spec(PrepareModuleInput(input_kwarg_layouts={"x": Shard(1)}, desired_input_kwarg_layouts={"x": R}), "tp")
    assert kw.inputs == {"x": TP_R} and kw.in_src == {"x": TP_S1}
    mixed = style_to_spec(PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                             input_kwarg_layouts={"gate": Shard(1)}, desired_input_kwarg_layouts={"gate": R}), "tp")
    assert mixed.inputs == {0: TP_R, 1: None, "gate": TP_R} and mixed.in_src == {0: TP_S1, 1: None, "gate": TP_S1}
    # torch leaves an argument with no input layout alone, whatever its desired layout
    lone = style_to_spec(PrepareModuleInput(input_layouts=(None,), desired_input_layouts=(Replicate(),),
                                            input_kwarg_layouts={}, desired_input_kwarg_layouts={}), "tp")
    assert lone.inputs == (None,) and lone.in_src == (None,)
    # a bare placement is one positional layout; desired=None annotates without redistributing
    bare = style_to_spec(PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=(None,)), "tp")
    assert bare.inputs == (None,) and bare.in_src == (TP_S1,)


def test_prepare_module_output_and_input_output():
    one = style_to_spec(PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()), "tp")
    assert one.out_src == TP_S1 and one.out_dst == TP_R
    two = style_to_spec(PrepareModuleOutput(output_layouts=(Shard(1), None), desired_output_layouts=(Replicate(), None)), "tp")
    assert two.out_src == (TP_S1, None) and two.out_dst == (TP_R, None)
    both = style_to_spec(PrepareModuleInputOutput(input_layouts=(Shard(1), None), desired_input_layouts=(R, None),
                                                  input_kwarg_layouts={"m": Shard(1)}, desired_input_kwarg_layouts={"m": R},
                                                  use_local_input=True, output_layouts=R, desired_output_layouts=Shard(1)), "tp")
    assert both.inputs == {0: TP_R, 1: None, "m": TP_R} and both.in_src == {0: TP_S1, 1: None, "m": TP_S1}
    assert both.out_src == TP_R and both.out_dst == TP_S1


def test_no_parallel_of_torchtitan():
    tt = pytest.importorskip("torchtitan.distributed.tensor_parallel")
    spec = style_to_spec(tt.NoParallel(input_layout=Shard(1), output_layout=Shard(1)), "tp")
    assert spec.params == {} and spec.inputs == TP_R and spec.in_src == TP_S1 and spec.out_dst == TP_S1
    assert style_to_spec(tt.NoParallel(use_local_output=True), "tp").out_dst == TP_R


def test_malformed_fields_are_named():
    c = ColwiseParallel()
    c.output_layouts = (Shard(-1), Replicate())
    with pytest.raises(PlanError, match=r"entry 'w1'.*output_layouts=.*one placement"):
        Plan.from_torch(TP2, {"w1": c})
    c = ColwiseParallel()
    c.desired_input_layouts = (Shard(1),)
    with pytest.raises(PlanError, match=r"entry 'w1'.*desired_input_layouts.*replicated input"):
        Plan.from_torch(TP2, {"w1": c})
    with pytest.raises(PlanError, match=r"entry 'w1': got the class ColwiseParallel"):
        Plan.from_torch(TP2, {"w1": ColwiseParallel})
    with pytest.raises(PlanError, match=r"axis="):
        Plan.from_torch(MeshSpec(("dp", "tp"), (2, 2)), {"w1": ColwiseParallel()})
    with pytest.raises(PlanError, match=r"dict \{fqn_pattern: ParallelStyle\} of submodules, got ColwiseParallel"):
        Plan.from_torch(TP2, ColwiseParallel())
    with pytest.raises(PlanError, match=r"axis='mp'"):
        Plan.from_torch(TP2, {"w1": ColwiseParallel()}, axis="mp")


def test_other_styles_are_refused_by_name():
    class Replicated(ParallelStyle):
        def _apply(self, module, device_mesh):
            return module

    with pytest.raises(PlanError, match=r"entry 'gate'.*Replicated.*write an fxshard.ModuleSpec"):
        Plan.from_torch(TP2, {"gate": Replicated()})
    from torch.distributed.tensor.parallel import loss_parallel

    with pytest.raises(PlanError, match=r"entry 'lm_head': loss_parallel is torch's context manager.*output_layouts=Shard\(-1\)"):
        Plan.from_torch(TP2, {"lm_head": loss_parallel})
    from torch.distributed.tensor.experimental._context_parallel._attention import _ContextParallel

    with pytest.raises(PlanError, match=r"entry 'attn'.*_ContextParallel.*fxshard.context_parallel"):
        Plan.from_torch(TP2, {"attn": _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)})


# ----------------------------------------------------------------------------- subclasses


class InertSequenceParallel(SequenceParallel):
    """Changes nothing: read as SequenceParallel."""


class FixedRowwise(RowwiseParallel):
    """Only fixes constructor arguments: read as RowwiseParallel."""

    def __init__(self):
        super().__init__(output_layouts=Shard(1))

    def __repr__(self):
        return "FixedRowwise()"


class SequenceParallelWithOutput(SequenceParallel):
    """A SequenceParallel that also redistributes its output (sets output layouts)."""

    def __init__(self, *, output_layouts, **kw):
        super().__init__(**kw)
        self.output_layouts = (output_layouts,)


class RedistributingSequenceParallel(SequenceParallel):
    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        return outputs.redistribute(placements=(Replicate(),))


def test_inert_subclasses_are_read_as_their_base():
    plan = Plan.from_torch(TP2, {"n": InertSequenceParallel(sequence_dim=0), "w2": FixedRowwise()})
    assert plan.specs["n"] == sequence_parallel("tp", dim=0)
    assert plan.specs["w2"] == rowwise("tp", out=Shard(1))
    styled = ColwiseParallel()
    styled.src_data_rank = None  # a field of every style: fxshard cuts each rank's shard from its own full copy
    assert Plan.from_torch(TP2, {"w1": styled}).specs["w1"] == colwise("tp")


@pytest.mark.parametrize("method", ["_apply", "_prepare_input_fn", "_prepare_output_fn", "_partition_linear_fn"])
@pytest.mark.parametrize("base", [ColwiseParallel, RowwiseParallel])
def test_a_subclass_overriding_a_method_is_refused(base, method):
    sub = type(f"My{base.__name__}", (base,), {method: lambda self, *a: None})
    with pytest.raises(PlanError, match=rf"entry 'w'.*My{base.__name__} \(a subclass of {base.__name__}\) overrides '{method}'"):
        Plan.from_torch(TP2, {"w": sub()})


def test_a_module_spec_in_a_torch_plan_is_taken_as_is():
    """The fix the refusals suggest, written in place of the style."""
    spec = ModuleSpec(inputs={"tp": Shard(1)}, out_src={"tp": Shard(1)}, out_dst={"tp": Replicate()})
    plan = Plan.from_torch(TP2, {"norm": spec, "w1": ColwiseParallel()})
    assert plan.specs["norm"] is spec and plan.specs["w1"] == colwise("tp")


def test_behaviour_changing_subclasses_are_refused_by_name():
    with pytest.raises(PlanError, match=r"entry 'norm'.*SequenceParallelWithOutput.*\['output_layouts'\].*ModuleSpec"):
        Plan.from_torch(TP2, {"norm": SequenceParallelWithOutput(output_layouts=Replicate())})
    with pytest.raises(PlanError, match=r"entry 'norm'.*RedistributingSequenceParallel.*overrides '_prepare_output_fn'.*ModuleSpec"):
        Plan.from_torch(TP2, {"norm": RedistributingSequenceParallel()})

    class Extra(ColwiseParallel):
        def shard_bias_too(self):
            return True

    with pytest.raises(PlanError, match=r"entry 'w1'.*Extra.*adds 'shard_bias_too'"):
        Plan.from_torch(TP2, {"w1": Extra()})


# ----------------------------------------------------------------------------- against parallelize_module

V, D, HID, B, S = 64, 16, 32, 2, 8


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, HID)
        self.w2 = nn.Linear(HID, D)

    def forward(self, x, scale, gate=None):
        return self.w2(F.silu(self.w1(x * gate))) * scale


class Net(nn.Module):
    """Embedding, sequence-parallel norms, an MLP called with a positional scalar and a
    keyword tensor, a vocab-parallel head; written for global shapes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)
        self.mlp = Mlp()
        self.out_norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        n = self.norm(h)
        gate = torch.sigmoid(n.sum(-1, keepdim=True))
        h = h + self.mlp(n, 0.5, gate=gate)
        return self.head(self.out_norm(h))


class NetWithLoss(Net):
    """The mean cross-entropy in the model: torch runs it under ``loss_parallel()`` on the
    vocab-sharded DTensor logits, fxshard on its shards (its loss_parallel pass)."""

    def forward(self, ids, labels):
        return F.cross_entropy(super().forward(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)


def make_net(cls=Net) -> Net:
    torch.manual_seed(0)
    net = cls()
    with torch.no_grad():  # non-trivial norm weights (torch's SequenceParallel assumes them replicated: they are)
        for norm in (net.norm, net.out_norm):
            norm.weight.add_(torch.randn_like(norm.weight) * 0.1)
            norm.bias.add_(torch.randn_like(norm.bias) * 0.1)
    return net


def torch_net_plan() -> dict:
    """Output layouts, both use_local_output values, mixed positional/keyword input
    layouts, an inert SequenceParallel subclass, a loss-parallel style head."""
    return {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(use_local_output=True),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                  input_kwarg_layouts={"gate": Shard(1)}, desired_input_kwarg_layouts={"gate": Replicate()},
                                  use_local_output=True),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        "out_norm": InertSequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def make_net_plan(mesh) -> Plan:
    return Plan.from_torch(mesh, torch_net_plan())


def net_ids() -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))


def net_labels() -> torch.Tensor:
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4))
    labels[:, :2] = -100  # a masked prompt
    return labels


def _check_grads(dmodel, sharded, mesh, what: str) -> None:
    grads = dict(sharded.named_parameters())
    for fqn, p in dmodel.named_parameters():
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grads[fqn].grad, expected_local(sharded, mesh, full, fqn), msg=lambda m: f"{what} grad of {fqn}: {m}")


def _sgd(*models) -> None:
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad = None


def _loss_parallel_against_dtensor(mesh):
    """The loss inside the model: parallelize_module + ``with loss_parallel()`` against the
    imported plan; loss and every gradient, then the loss after an SGD step."""
    from torch.distributed.tensor.parallel import loss_parallel

    model = make_net(NetWithLoss)
    dmodel = parallelize_module(copy.deepcopy(model), mesh, torch_net_plan())
    ids, labels = net_ids(), net_labels()
    sharded = fxshard.transform(model, make_net_plan(mesh), (torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))))
    for step in range(2):
        with loss_parallel():
            theirs = dmodel(ids, labels)
            theirs.backward()
        ours = sharded(ids, labels)
        ours.backward()
        torch.testing.assert_close(ours, theirs.full_tensor(), msg=lambda m: f"loss_parallel step {step} loss: {m}")
        _check_grads(dmodel, sharded, mesh, f"loss_parallel step {step}")
        _sgd(dmodel, sharded)


def _against_dtensor(sharded_after_steps, mesh, rank, world_size):
    """Fresh: Plan.from_torch + fxshard.transform vs parallelize_module on a copy of the
    same model, same ids: logits, every parameter gradient, and logits after an SGD step."""
    model = make_net()
    dmodel = parallelize_module(copy.deepcopy(model), mesh, torch_net_plan())
    ids = net_ids()
    sharded = fxshard.transform(model, make_net_plan(mesh), (torch.randint(0, V, (B, S)),))
    weights = torch.randn(B, S, V, generator=torch.Generator().manual_seed(5))
    lo, hi = rank * V // world_size, (rank + 1) * V // world_size
    for step in range(2):
        theirs = dmodel(ids)
        assert isinstance(theirs, DTensor) and theirs.placements == (Shard(2),)  # use_local_output=False kept a DTensor
        ours = sharded(ids)
        torch.testing.assert_close(ours, theirs.to_local(), msg=lambda m: f"step {step} logits: {m}")
        (theirs.full_tensor() * weights).sum().backward()
        (ours * weights[..., lo:hi]).sum().backward()  # this rank's vocab slice of the same objective
        _check_grads(dmodel, sharded, mesh, f"step {step}")
        _sgd(dmodel, sharded)
    _loss_parallel_against_dtensor(mesh)


def test_from_torch_equals_parallelize_module_on_gloo():
    """tp=2, real gloo: the imported plan is exact against one device (outputs, input and
    parameter gradients, 2 SGD steps) and against parallelize_module with that plan
    (logits, gradients, a step later; and with the loss in the model under loss_parallel())."""
    case = Case(make_net, make_net_plan, (net_ids(),), {"tp": 2}, example_inputs=(torch.randint(0, V, (B, S)),),
                post=_against_dtensor, name="from_torch mixed layouts")
    check_real_cases(2, [case])
