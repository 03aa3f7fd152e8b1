"""replicate_heads: more TP ranks than KV heads (``colwise(heads=n)``).  Each rank holds the
KV head its query heads use; the K/V gradients are summed over the ranks sharing a head."""
from __future__ import annotations

import functools
import re

import pytest
import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import MeshSpec, Plan, PlanError, colwise
from fxshard.layout.placements import HeadReplicas
from fxshard.testing import models

from equivalence import Case, check_real_cases, check_simulated
from fxshard.meta import program_meta

transformers = pytest.importorskip("transformers")

V = 128
QWEN2 = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _qwen2(attn="sdpa"):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**QWEN2)
    cfg._attn_implementation = attn
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _batch():
    """Ids and labels: distinct tensors, labels with -100 padding (tiny_inputs)."""
    from fxshard.testing.hf_tiny import tiny_inputs

    ids, labels = tiny_inputs(2, 8, V, seed=0)
    return {"input_ids": ids, "labels": labels}


def _hf_plan(mesh, attn="sdpa"):
    return Plan.from_hf(mesh, _qwen2(attn))


def _logits(out):
    return out.logits


def _loss(out):
    return out.loss


CHECK = dict(select=_logits, loss_fn=_loss, replicated_loss=True, lr=0.2)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_qwen2_two_kv_heads_at_tp4_exact(attn):
    """HF's plan at tp=4 on 2 KV heads: from_hf asks for heads=2, each pair of ranks shares a head."""
    plan = _hf_plan(MeshSpec(("tp",), (4,)), attn)
    assert plan.specs["model.layers.*.self_attn.k_proj"].heads == 2
    sharded = check_simulated(functools.partial(_qwen2, attn), functools.partial(_hf_plan, attn=attn), (), {"tp": 4},
                              kwargs=_batch(), **CHECK)
    wk = "model.layers.0.self_attn.k_proj.weight"
    assert program_meta(sharded).heads[wk] == HeadReplicas("tp", 2)
    assert program_meta(sharded).state[wk] == ({"tp": Shard(0)}, (16, 64))  # the real global shape: 2 heads of 8
    s = fxshard.comm_summary(sharded)
    rows = [r for r in s.rows if "replicated heads" in r.purpose]
    # k and v, weight and bias, per layer (bucketed): summed over the 2 ranks of each head
    assert rows and all(r.axis_size == 2 and r.phase == "backward" for r in rows)
    assert sum(r.bytes for r in rows) == 2 * 2 * (8 * 64 + 8) * 4  # one head per rank
    assert "replicas = 2" in sharded.code  # fx prints keywords spaced
    assert "S(0) x2" in fxshard.dump(sharded, "model.layers.0.self_attn.k_proj")
    assert "each held by 2 ranks of 'tp'" in fxshard.explain(sharded, "model_layers_0_self_attn_k_proj_weight")
    assert "tp/2" in str(s)  # the comm summary's axis column: a group of 2 ranks of tp


def test_qwen2_two_kv_heads_at_tp4_real_gloo():
    check_real_cases(4, [Case(_qwen2, _hf_plan, (), {"tp": 4}, kwargs=_batch(), name="qwen2 kv=2 tp=4", **CHECK)])


def test_llama_view_and_repeat_interleave():
    """fxshard's own Llama (a view with the KV head count, complex rope, repeat_interleave) at tp=4
    with 2 KV heads (the state's round trip: tests/test_state.py)."""
    args = models.LlamaArgs(n_heads=8, n_kv_heads=2)
    ids = models.tokens(2, 8, args.vocab_size)

    def plan(mesh):
        p = models.llama_plan()
        for name in ("wk", "wv"):
            p[f"layers.*.attention.{name}"] = colwise(heads=2)
        return Plan(mesh, p)

    model = functools.partial(models.llama, args=args)
    sharded = check_simulated(model, plan, (ids,), {"tp": 4})
    code = sharded.code  # per rank: one KV head of 8, repeated for the rank's 2 query heads (not 4)
    assert len(re.findall(r"\.view\(\w+, \w+, 1, 8\)", code)) == 2 * args.n_layers, code
    assert len(re.findall(r"repeat_interleave\(\w+, 2, dim = 2\)", code)) == 2 * args.n_layers, code

def test_wrong_uses_are_plan_errors():
    mesh = MeshSpec(("tp",), (4,))
    ids = models.tokens(2, 8, 128)
    model = models.llama(args=models.LlamaArgs(dim=48, n_heads=6, n_kv_heads=3))
    p = models.llama_plan()
    p["layers.*.attention.wk"] = colwise(heads=3)
    with pytest.raises(PlanError, match="not a multiple of its 3 heads"):
        fxshard.transform(model, Plan(mesh, p), (ids,))
    p = models.llama_plan()
    p["layers.*.attention.wk"] = colwise(heads=3)
    with pytest.raises(PlanError, match="cannot be cut over the 2 ranks"):
        fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), p), (ids,))
    with pytest.raises(PlanError, match="heads of a fused projection"):
        colwise(splits=[4, 2, 2], heads=2)
    with pytest.raises(PlanError, match="positive int"):
        colwise(heads=0)


def test_dp_by_tp_mesh():
    """On dp x tp the heads are shared within each tp group; the weights' gradients are
    summed over the head's replicas, then over dp."""
    args = models.LlamaArgs(n_heads=8, n_kv_heads=2, n_layers=1)
    ids = models.tokens(4, 8, args.vocab_size)

    def plan(mesh):
        p = {**models.llama_plan(), "layers.*.attention.wk": colwise(heads=2), "layers.*.attention.wv": colwise(heads=2)}
        return Plan(mesh, p, inputs={"tokens": {"dp": Shard(0)}})

    sharded = check_simulated(functools.partial(models.llama, args=args), plan, (ids,), {"dp": 2, "tp": 4})
    rows = [r for r in fxshard.comm_summary(sharded).rows if "replicated heads" in r.purpose]
    assert rows and {(r.axis, r.axis_size) for r in rows} == {("tp", 2)}


def test_missing_heads_suggests_them():
    model = models.llama(args=models.LlamaArgs(n_heads=8, n_kv_heads=2))
    with pytest.raises(PlanError, match=r"fxshard.colwise\('tp', heads=2\)"):
        fxshard.transform(model, Plan(MeshSpec(("tp",), (4,)), models.llama_plan()), (models.tokens(2, 8, 128),))


class GQA(torch.nn.Module):
    """Grouped-query attention that lets SDPA pair the heads (enable_gqa=True): no repeat_kv."""

    def __init__(self, dim=32, heads=8, kv_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q_proj = torch.nn.Linear(dim, dim)
        self.k_proj = torch.nn.Linear(dim, kv_heads * self.hd)
        self.v_proj = torch.nn.Linear(dim, kv_heads * self.hd)
        self.o_proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


def test_sdpa_enable_gqa():
    def plan(mesh):
        return Plan(mesh, {"q_proj": colwise(), "k_proj": colwise(heads=2), "v_proj": colwise(heads=2),
                           "o_proj": fxshard.rowwise()})

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    sharded = check_simulated(GQA, plan, (x,), {"tp": 4})
    assert "enable_gqa = True" in sharded.code
