"""Plain tensor attributes and lifted constants survive capture (fx and export), the
transform's copy, sharding (a layout from the plan, like any buffer), ``state_dict``
round trips (keys stay the model's), ``.to(device)`` and ``materialize``: the front end
makes every plain tensor the graph reads a non-persistent buffer under its FQN."""
import copy
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.distributed.tensor import Shard

import fxshard
from equivalence import Case, check_real_cases, expected_local
from fxshard import MeshSpec, ModuleSpec, Plan, PlanError, colwise, rowwise

D, H, T = 32, 4, 8


class Attention(nn.Module):
    """nanoGPT-style causal attention whose tables are plain attributes, not buffers."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(D, D) for _ in range(4))
        self.mask = torch.tril(torch.ones(T, T)).view(1, 1, T, T)          # set in __init__
        self.head_scale = torch.linspace(0.5, 1.5, H).view(1, H, 1, 1)     # one per head: the plan shards it
        self.rope = None                                                   # set by setup_caches()

    def setup_caches(self):
        hd = D // H
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        self.rope = torch.outer(torch.arange(T).float(), inv).repeat(1, 2).cos()

    def heads(self, t, B):
        return t.view(B, T, H, D // H).transpose(1, 2)

    def forward(self, x):
        B = x.shape[0]
        q, k, v = self.heads(self.q(x), B), self.heads(self.k(x), B), self.heads(self.v(x), B)
        q = q * self.rope
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // H)) * self.head_scale
        att = att.masked_fill(self.mask == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = Attention()
        self.scale = torch.full((D,), 0.75)  # a root-level plain attribute
        self.attn.setup_caches()

    def forward(self, x):
        return self.attn(x) * self.scale


class ExportedNet(Net):
    """Not fx-traceable (a branch on a size): captured by torch.export."""

    def forward(self, x):
        if x.shape[0] > 0:
            x = x * 1.0
        return self.attn(x) * self.scale


def net_plan(mesh):
    return Plan(mesh, {"attn.q": colwise(), "attn.k": colwise(), "attn.v": colwise(), "attn.proj": rowwise(),
                       "attn": ModuleSpec(params={"head_scale": {"tp": Shard(1)}})})


MODEL_KEYS = sorted(Net().state_dict())
ATTRIBUTES = ["attn.head_scale", "attn.mask", "attn.rope", "scale"]


def check_state(sharded, mesh, rank, world_size):
    """On each real rank: the model's state_dict keys, the attributes as buffers (the
    per-head one sharded), a state_dict round trip, ``.to('meta')`` and back."""
    assert sorted(sharded.state_dict()) == MODEL_KEYS
    buffers = dict(sharded.named_buffers())
    assert sorted(buffers) == ATTRIBUTES
    assert buffers["attn.head_scale"].shape == (1, H // 2, 1, 1)
    torch.testing.assert_close(buffers["attn.head_scale"], Net().attn.head_scale[:, 2 * rank:2 * rank + 2])
    sharded.load_state_dict(sharded.state_dict())
    on_meta = copy.deepcopy(sharded).to("meta")
    assert sorted(n for n, b in on_meta.named_buffers() if b.is_meta) == ATTRIBUTES
    mask = buffers["attn.mask"]
    assert sharded.to("cpu").get_buffer("attn.mask") is mask and torch.equal(mask, Net().attn.mask)


def _x(seed):
    return torch.randn(2, T, D, generator=torch.Generator().manual_seed(seed))


def t5():
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16, vocab_size=128, decoder_start_token_id=0,
        dropout_rate=0.0))


def t5_plan(mesh):
    return Plan(mesh, {"*.block.*.layer.*.DenseReluDense.wi": colwise(), "*.block.*.layer.*.DenseReluDense.wo": rowwise()})


def logits(out):
    return out.logits


def model_loss(out):
    return out.loss


def _t5_batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(3, 128, (2, 8), generator=g), torch.randint(3, 128, (2, 6), generator=g)
    labels[:, :2] = -100
    return {"input_ids": ids, "labels": labels}


def test_attribute_tensors_and_lifted_constants_tp2_real_gloo():
    """fx and export captures of the model with plain attributes, the per-head one
    sharded by the plan, and T5 (constants export lifts): outputs, gradients and a
    step equal to one device, at tp=2 on real gloo."""
    cases = [Case(factory, net_plan, (_x(1),), {"tp": 2}, example_inputs=(_x(2),), post=check_state, lr=0.5,
                  name=f"{factory.__name__} plain attributes")
             for factory in (Net, ExportedNet)]
    cases.append(Case(t5, t5_plan, (), {"tp": 2}, kwargs=_t5_batch(3), example_kwargs=_t5_batch(4), select=logits,
                      loss_fn=model_loss, replicated_loss=True, lr=0.2, name="t5 lifted constants"))
    check_real_cases(2, cases)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_trace_keeps_the_model_and_its_keys(capture):
    model = Net()
    gm = fxshard.trace(model, None, (_x(1),), capture=capture)
    assert sorted(gm.state_dict()) == MODEL_KEYS
    assert sorted(n for n, _ in gm.named_buffers()) == ATTRIBUTES
    assert {n.target for n in gm.graph.nodes if n.op == "get_attr"} >= set(ATTRIBUTES)
    torch.testing.assert_close(gm(_x(5)), model(_x(5)))
    # the model itself is untouched: its attributes are plain tensors again, nothing added
    assert isinstance(vars(model.attn)["mask"], torch.Tensor) and not dict(model.named_buffers())
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]


def test_transform_of_a_graph_module_with_plain_attributes():
    """A plain ``torch.fx.symbolic_trace`` / ``ep.module()`` GraphModule reads plain
    attributes too (at the root): the transform's copy keeps them, as buffers."""
    model = Net()
    ep = torch.export.export(model, (_x(1),), strict=False).module()
    sharded = fxshard.transform(ep, Plan(MeshSpec(("tp",), (1,)), {}), example_inputs=(_x(1),))
    torch.testing.assert_close(sharded(_x(5)), model(_x(5)))
    assert set(ATTRIBUTES) <= {n for n, _ in sharded.named_buffers()}
    assert sorted(sharded.state_dict()) == MODEL_KEYS


def init_net(model):
    """Reset the linears and compute the tables, as ``Net.__init__`` does."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    model.attn.mask = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
    model.attn.head_scale = torch.linspace(0.5, 1.5, H).view(1, H, 1, 1)
    model.attn.setup_caches()
    model.scale = torch.full((D,), 0.75)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_materialize_from_meta(capture):
    with torch.device("meta"):
        model = Net()
    mesh = MeshSpec(("tp",), (2,), coordinate=(1,))
    sharded = fxshard.transform(model, net_plan(mesh), example_inputs=(_x(1).to("meta"),), capture=capture)
    with pytest.raises(PlanError, match="attn.mask"):  # the default init cannot compute a plain attribute
        fxshard.materialize(sharded, model)
    torch.manual_seed(0)
    fxshard.materialize(sharded, model, init=init_net)
    reference = Net()
    torch.manual_seed(0)
    init_net(reference)
    full = dict(reference.named_parameters()) | {fqn: getattr(reference.get_submodule(fqn.rpartition(".")[0]),
                                                              fqn.rpartition(".")[2]) for fqn in ATTRIBUTES}
    for fqn, t in list(sharded.named_parameters()) + list(sharded.named_buffers()):
        torch.testing.assert_close(t, expected_local(sharded, mesh, full[fqn], fqn), msg=fqn)
    assert sorted(sharded.state_dict()) == MODEL_KEYS


def test_a_meta_model_after_from_pretrained(tmp_path):
    """``from_pretrained`` swaps ``torch.linspace`` while it builds on meta; torch's table of
    the factories a ``torch.device`` block redirects, filled then, would keep every later
    ``torch.linspace`` on the CPU (the test above failed so, run after an HF load in the same
    process). Importing fxshard fills the table first: run in a fresh process, in that order."""
    script = f"""
import torch, transformers, fxshard
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2)
transformers.LlamaForCausalLM(cfg).save_pretrained({str(tmp_path)!r})
transformers.LlamaForCausalLM.from_pretrained({str(tmp_path)!r})
with torch.device("meta"):
    print("linspace on", torch.linspace(0.5, 1.5, 4).device)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "linspace on meta" in out.stdout, out.stdout
