"""fxshard.frontend.capture: torch.export (non-strict) normalized into the graph form the
passes expect: boundary markers by argument name, torch-level ops, no guards, the
model's FQNs and call convention, dynamic batch and sequence."""
import pytest
import torch
import torch.nn as nn

import fxshard
from equivalence import check_simulated
from fxshard import MeshSpec, Plan, PlanError, colwise, rowwise
from torch.distributed.tensor import Replicate
from fxshard.markers import region_input, region_output
from fxshard.meta import program_meta


class Block(nn.Module):
    """Not fx-traceable: it unpacks a shape and branches on a size, as HF code does."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x, scale=None):
        b, s, _ = x.shape
        h = self.up(x).view(b, s, 4, 4)
        if s > 1:  # control flow on a size: symbolic_trace refuses it
            h = h * 2.0
        y = self.down(h.flatten(2))
        return {"out": y if scale is None else y * scale}


def _plan(mesh=MeshSpec(("tp",), (2,))):
    return Plan(mesh, {"up": colwise(), "down": rowwise()})


X = torch.randn(2, 6, 8)


def test_untraceable_model_is_exported_and_normalized():
    gm = fxshard.trace(Block(), _plan(), (X,))
    assert program_meta(gm).captured_by == "torch.export"
    markers = [(n.target.__name__, n.args[1], n.args[2]) for n in gm.graph.nodes if n.target in (region_input, region_output)]
    assert ("region_input", "up", "input") in markers and ("region_output", "down", "output") in markers
    code = gm.code
    assert "torch.ops.aten.linear" not in code and "torch._C._nn.linear" in code and ".view(" in code
    assert "_guards_fn" not in code and "_assert" not in code
    assert {n.target for n in gm.graph.nodes if n.op == "get_attr"} == {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert isinstance(gm(X)["out"], torch.Tensor)  # the model's output structure


def test_exported_model_is_equal_and_dynamic():
    check_simulated(Block, _plan, (torch.randn(3, 5, 8),), {"tp": 2}, select=lambda o: o["out"], example_inputs=(X,))


def test_keyword_inputs_and_batch_of_one_example():
    def loss(o, t):
        return ((o["out"] - t) ** 2).sum()

    x = torch.randn(3, 4, 8)
    check_simulated(Block, _plan, (), {"tp": 2}, kwargs={"x": x, "scale": torch.tensor(0.5)},
                    example_kwargs={"x": torch.randn(1, 1, 8), "scale": torch.tensor(0.5)},
                    select=lambda o: o["out"], loss_fn=loss, targets=(torch.randn(3, 4, 8),), replicated_loss=True)


class NoGradTopK(nn.Module):
    """A ``torch.no_grad()`` block (exported as a higher-order op) whose outputs are a
    tensor and a size (``min(k, h.shape[-2])``)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False)
        self.w2 = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = self.w1(x)
        with torch.no_grad():
            k = min(4, h.shape[-2])
            idx = h.sum(-1).topk(k, dim=-1).indices
        y = self.w2(h).sum(-1).gather(-1, idx)
        return y + y.new_zeros(y.shape[0], k)


def test_no_grad_block_is_inlined():
    plan = lambda mesh: Plan(mesh, {"w1": colwise(), "w2": rowwise()})  # noqa: E731
    gm = fxshard.trace(NoGradTopK(), plan(MeshSpec(("tp",), (2,))), example_kwargs={"x": torch.randn(2, 8, 8)}, capture="export")
    assert not any("wrap_with_set_grad_enabled" in str(n.target) for n in gm.graph.nodes)
    assert torch.is_grad_enabled()


class NoGradHandsBack(nn.Module):
    """Dots-3's indexer: a no-grad block reads ``h.to(torch.float32)``, which *is* ``h``
    (already float32), and export routes the later use of ``h`` through the block's output."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False)
        self.w2 = nn.Linear(16, 8, bias=False)

    @torch.no_grad()
    def pick(self, h):
        h = h.to(torch.float32)
        return h.sum(-1).argmax(-1), h

    def forward(self, x):
        h = self.w1(x)
        idx, _ = self.pick(h)
        return self.w2(h).sum(-1).gather(-1, idx[..., None])


def test_a_no_grad_block_handing_its_input_back_keeps_its_gradient():
    model, x = NoGradHandsBack(), torch.randn(2, 8, 8)
    gm = fxshard.trace(model, None, example_kwargs={"x": x}, capture="export")
    gm(x=x).sum().backward()
    want = {n: p.grad for n, p in gm.named_parameters()}
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(want[n], p.grad, msg=n)


class Autocasts(nn.Module):
    """torchtitan's router: ``with torch.autocast(device, dtype=float32)`` around the
    gate, here also nested in a no-grad block; ``dtype`` bf16 really casts on CPU."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.gate, self.out, self.dtype = nn.Linear(8, 8), nn.Linear(8, 8), dtype

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.dtype):
            h = self.gate(x)
        with torch.no_grad():
            with torch.autocast(x.device.type, dtype=self.dtype):
                scale = self.gate(x).float().sigmoid()
        return self.out(h.float()) * scale


@pytest.mark.filterwarnings("ignore:In CPU autocast")
def test_autocast_blocks_that_cast_nothing_are_inlined_and_shard():
    """Float32 autocast is off on CPU: the block is its body, so the gate's linear gets
    a layout rule (colwise here) instead of an opaque higher-order op."""
    x = torch.randn(2, 4, 8)
    gm = fxshard.trace(Autocasts(), None, (x,), capture="export")
    assert "wrap_with_autocast" not in gm.code and "wrap_with_set_grad_enabled" not in gm.code
    check_simulated(Autocasts, lambda mesh: Plan(mesh, {"gate": colwise("tp", out=Replicate())}), (x,), {"tp": 2})


def test_an_autocast_block_that_casts_stays_whole():
    gm = fxshard.trace(Autocasts(torch.bfloat16), None, (torch.randn(2, 4, 8),), capture="export")
    assert "wrap_with_autocast" in gm.code  # inlining would drop its casts to bf16


def test_input_model_and_grad_mode_untouched():
    model = Block()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fxshard.transform(model, _plan(), (X,))
    assert not model._forward_hooks and not model._forward_pre_hooks and not model.up._forward_pre_hooks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and torch.is_grad_enabled()


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if self.fc(x).sum() > 0:  # branches on a value: nothing can capture it
            return x
        return -x


def test_uncapturable_model_is_a_plan_error():
    with pytest.raises(PlanError, match="torch.export"):
        fxshard.transform(DataDependent(), Plan(MeshSpec(("tp",), (2,)), {"fc": colwise()}), (X,))
    with pytest.raises(PlanError, match="capture='export'"):
        fxshard.trace(Block(), None, (X,), capture="fx")
