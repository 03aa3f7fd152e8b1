"""Inputs are bound by argument name, never by tensor identity: whatever the example
tensors share (one tensor under two names, views of one base, a view of another input,
a parameter or a slice of one passed as an input), every forward argument is its own
placeholder, and the program called later with distinct tensors computes the model's
result.  (``torch.export`` fakeifies a tensor once: ``example_kwargs={"input_ids": ids,
"labels": ids}`` used to give a graph whose embedding read ``labels``.)"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import fxshard
from torch.distributed.tensor import Replicate
from equivalence import Case, check_real_cases
from harness import plain, rank_value, simulated


class Pair(nn.Module):
    """Two float inputs of their own batch sizes, through two layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.a(x).sum(0) + 2 * self.b(y).square().sum(0)


def _aliased(kind: str, model: Pair):
    """Example ``(x, y)`` sharing storage in the way ``kind`` says."""
    g = torch.Generator().manual_seed(1)
    if kind == "same_tensor":
        t = torch.randn(4, 8, generator=g)
        return t, t
    if kind == "views_of_one_base":
        base = torch.randn(4, 16, generator=g)
        return base[:, :8], base[:, 8:]
    if kind == "view_of_other_input":
        t = torch.randn(4, 8, generator=g)
        return t, t.view(2, 2, 8)[1]
    if kind == "parameter":
        return model.a.weight, torch.randn(3, 8, generator=g)
    if kind == "parameter_slice":
        return model.a.weight, model.a.weight[2:6]
    if kind == "buffer_like_input_on_meta":
        t = torch.empty(4, 8, device="meta")
        return t, t
    raise ValueError(kind)


KINDS = ["same_tensor", "views_of_one_base", "view_of_other_input", "parameter", "parameter_slice"]


def _run_inputs(x_shape, y_shape):
    """Distinct tensors of the example shapes (a float input's batch may be specialized)."""
    g = torch.Generator().manual_seed(2)
    return torch.randn(x_shape, generator=g, requires_grad=True), torch.randn(y_shape, generator=g, requires_grad=True)


def _check_equal(run, model, shapes):
    x, y = _run_inputs(*shapes)
    got = run(x, y)
    gx, gy = torch.autograd.grad(got.sum(), (x, y))
    want = model(x, y)
    wx, wy = torch.autograd.grad(want.sum(), (x, y))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gy, wy)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("kind", KINDS)
def test_trace_binds_each_argument_by_name(kind, capture):
    model = Pair()
    x, y = _aliased(kind, model)
    gm = fxshard.trace(model, None, (x, y), capture=capture)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 2 and all(n.users for n in placeholders)
    _check_equal(gm, model, (x.shape, y.shape))


@pytest.mark.parametrize("kind", KINDS)
def test_transform_binds_each_argument_by_name(kind):
    """Through ``fxshard.transform`` (export capture, simulated tp=2 with ``a`` and ``b``
    sharded), and a plain ``torch.fx.symbolic_trace`` GraphModule given aliased examples."""
    model = Pair()
    x, y = _aliased(kind, model)
    with simulated({"tp": 2}) as mesh:
        plan = fxshard.Plan(mesh, {"a": fxshard.colwise(out=Replicate()), "b": fxshard.rowwise(inputs=Replicate())})
        for obj, kw in ((model, {"capture": "export"}), (torch.fx.symbolic_trace(model), {})):
            sharded = fxshard.transform(obj, plan, example_inputs=(x, y), **kw)
            with plain():
                xr, yr = _run_inputs(x.shape, y.shape)
                want = model(xr, yr)
            got = sharded(xr, yr)
            for r in range(2):
                torch.testing.assert_close(rank_value(got, r), want)


def test_meta_examples_are_distinct_inputs():
    """On the meta device too: one meta tensor under two names is two placeholders."""
    with torch.device("meta"):
        model = Pair()
    t = torch.empty(4, 8, device="meta")
    gm = fxshard.trace(model, None, example_kwargs={"x": t, "y": t})
    reads = {n.target: [u.target for u in n.users] for n in gm.graph.nodes if n.op == "placeholder"}
    assert len(reads) == 2 and all(reads.values())


class TokenLoss(nn.Module):
    """ids and labels of one shape: the README's ``labels=ids`` example."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_labels_equal_to_ids_in_the_example():
    model = TokenLoss()
    ids = torch.randint(0, 32, (2, 6))
    gm = fxshard.trace(model, None, example_kwargs={"input_ids": ids, "labels": ids})
    g = torch.Generator().manual_seed(3)
    run_ids, labels = torch.randint(0, 32, (2, 6), generator=g), torch.randint(0, 32, (2, 6), generator=g)
    labels[:, :2] = -100
    torch.testing.assert_close(gm(input_ids=run_ids, labels=labels), model(input_ids=run_ids, labels=labels))


# ----------------------------------------------------------------------------- HF Llama at tp=2, real gloo

V = 128


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0))


def llama_plan(mesh):
    return fxshard.Plan.from_hf(mesh, llama())


def logits(out):
    return out.logits


def model_loss(out):
    return out.loss


def test_hf_llama_example_labels_are_ids_real_gloo():
    """The README quick start's example (``labels=ids``), run with other ids and labels
    carrying -100: loss, logits, every gradient and a step later equal the model's."""
    g = torch.Generator().manual_seed(5)
    example = torch.randint(3, V, (2, 8), generator=g)
    ids, labels = torch.randint(3, V, (2, 8), generator=g), torch.randint(3, V, (2, 8), generator=g)
    labels[:, :2] = -100
    labels[0, 5] = -100
    case = Case(llama, llama_plan, (), {"tp": 2}, kwargs={"input_ids": ids, "labels": labels},
                example_kwargs={"input_ids": example, "labels": example}, select=logits, loss_fn=model_loss,
                replicated_loss=True, lr=0.2, name="llama labels=ids example")
    check_real_cases(2, [case])
