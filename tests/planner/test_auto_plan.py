"""fxshard.auto_plan: the Megatron structure found in the captured graph.

On fxshard's Llama and GPT-2 it reproduces the hand-written plans' blocks (the same
collectives); on HF Phi-3 (fused qkv/gate_up) and OLMo2 (q/k norms over the projected
width) it is exact and communicates strictly less than HF's own plan."""
from __future__ import annotations

import functools

import pytest
import torch

import fxshard
from fxshard import MeshSpec, Plan, PlanError
from fxshard.testing import models

from equivalence import Case, check_real_cases, check_simulated

MESH = MeshSpec(("tp",), (2,))


def _wire(gm, region=None) -> int:
    return sum(r.wire_bytes for r in fxshard.comm_summary(gm).select(region=region))


def _rows(gm, region):
    return [(r.phase, r.kind, r.shape) for r in fxshard.comm_summary(gm).select(region=region)]


def test_llama_reproduces_the_hand_written_plan():
    model, ids = models.llama(), models.tokens(2, 8, 128)
    plan = fxshard.auto_plan(model, MESH, (ids,), vocab=False)
    assert plan.specs == models.llama_plan(), plan
    text = repr(plan)
    assert "# wq/wk/wv -> wo: megatron" in text and "# w1/w3 -> w2: megatron" in text
    assert "considered" in text


@pytest.mark.parametrize("flags", [dict(), dict(sequence_parallel=True, loss_parallel=True)], ids=["tp", "sp+lp"])
def test_printed_plan_is_the_code_that_builds_it(flags):
    from torch.distributed.tensor import Replicate, Shard

    model, ids = models.gpt2(), models.tokens(2, 8, 128)
    plan = fxshard.auto_plan(model, MESH, (ids,), **flags)
    scope = {"fxshard": fxshard, "Shard": Shard, "Replicate": Replicate, "mesh": MESH}
    exec(repr(plan), scope)
    assert scope["plan"] == Plan(MESH, plan.specs)
    assert all(not line.startswith("    '") or "# " in line for line in repr(plan).splitlines()), "a comment per entry"


def test_gpt2_blocks_as_hand_written_and_no_more_communication():
    model, ids = models.gpt2(), models.tokens(2, 8, 128)
    plan = fxshard.auto_plan(model, MESH, (ids,))
    hand = models.gpt2_plan()
    for pattern in ("h.*.attn.c_attn", "h.*.attn.c_proj", "h.*.mlp.c_fc", "h.*.mlp.c_proj", "lm_head"):
        assert plan.specs[pattern] == hand[pattern], pattern
    assert plan.specs["h.*.attn.c_attn"].splits == (64, 64, 64)  # found from the split that follows
    ours = fxshard.transform(model, plan, example_inputs=(ids,))
    theirs = fxshard.transform(model, Plan(MESH, hand), example_inputs=(ids,))
    assert _rows(ours, "h.*") == _rows(theirs, "h.*")
    assert _wire(ours) <= _wire(theirs)  # the embedding: an all-gather instead of an all-reduce


def test_llama_sequence_parallel_blocks_and_norms_as_hand_written():
    model, ids = models.llama(), models.tokens(2, 8, 128)
    hand = models.llama_plan(sequence_parallel=True)
    plan = check_simulated(models.llama, lambda mesh: fxshard.auto_plan(model, mesh, (ids.clone(),), vocab=False, sequence_parallel=True),
                           (ids,), {"tp": 2})
    auto = fxshard.auto_plan(model, MESH, (ids,), vocab=False, sequence_parallel=True)
    for pattern in ("layers.*.attention_norm", "layers.*.ffn_norm", "norm", "layers.*.attention.wo", "layers.*.feed_forward.w2"):
        assert auto.specs[pattern] == hand[pattern], pattern
    assert auto.specs["layers.*.attention.wq"].in_src == {"tp": torch.distributed.tensor.Shard(1)}
    s = fxshard.comm_summary(plan)
    assert s.count("forward", "reduce_scatter") == 4 and s.count("forward", "all_reduce") == 0


V = 128
HF = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hf(family):
    transformers = pytest.importorskip("transformers")
    cls = {"phi3": transformers.Phi3Config, "olmo2": transformers.Olmo2Config}[family]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cls(**HF))


def _batch():
    """Ids and labels: distinct tensors, labels with -100 padding (tiny_inputs)."""
    from fxshard.testing.hf_tiny import tiny_inputs

    ids, labels = tiny_inputs(2, 8, V, seed=0)
    return {"input_ids": ids, "labels": labels}


def logits(out):
    return out.logits


def model_loss(out):
    return out.loss


def _with_specs(mesh, specs):
    return Plan(mesh, specs)


CHECK = dict(select=logits, loss_fn=model_loss, replicated_loss=True, lr=0.2)
AUTO = {}  # family -> auto_plan's specs, found once on a MeshSpec and reused on every mesh


def _auto_specs(family):
    if family not in AUTO:
        AUTO[family] = fxshard.auto_plan(_hf(family), MESH, example_kwargs=_batch())
    return AUTO[family]


@pytest.mark.parametrize("family,found", [("phi3", "qkv_proj fused [64, 32, 32]"),
                                          ("olmo2", "norms over the projected width: k_norm, q_norm")])
def test_hf_auto_plan_exact_and_cheaper_than_hf_plan(family, found):
    batch = _batch()
    plan = _auto_specs(family)
    assert found in repr(plan)
    sharded = check_simulated(functools.partial(_hf, family), functools.partial(_with_specs, specs=plan.specs), (), {"tp": 2},
                              kwargs=batch, **CHECK)
    hf = fxshard.transform(_hf(family), Plan.from_hf(MESH, _hf(family)), example_kwargs=batch)
    assert _wire(sharded) < _wire(hf), (_wire(sharded), _wire(hf))
    assert fxshard.comm_summary(sharded).count(kind="all_gather") < fxshard.comm_summary(hf).count(kind="all_gather")


def test_never_worse_than_the_models_own_plan():
    """A tiny GPT-NeoX at tp=2: auto_plan's own search (a vocab-parallel or gathered embedding, a gathered
    LM head) sends more per step than HF's plan (embedding whole); the model's own plan is a candidate and
    is kept, and what it leaves replicated says so."""
    from fxshard.testing.hf_tiny import tiny_model

    batch = _batch()
    model = tiny_model("gpt_neox")
    hf = _wire(fxshard.transform(model, Plan.from_hf(MESH, model), example_kwargs=batch))
    plan = fxshard.auto_plan(model, MESH, example_kwargs=batch)
    auto = _wire(fxshard.transform(model, plan, example_kwargs=batch))
    assert auto <= hf, (auto, hf)
    assert plan.specs == Plan.from_hf(MESH, model).specs
    assert "the model's own plan (Plan.from_hf)" in repr(plan)
    assert all("the model's own plan" in why for why in plan.left_whole.values()), plan.left_whole
    # the options HF's plans do not answer leave the search alone (its plans gather the logits)
    lp = fxshard.auto_plan(model, MESH, example_kwargs=batch, loss_parallel=True)
    assert "the model's own plan" not in repr(lp)


def test_hf_auto_plan_on_the_meta_device():
    """auto_plan reads shapes only: a model too big for the host is planned on the meta device."""
    with torch.device("meta"):
        model = _hf("phi3")
    assert fxshard.auto_plan(model, MESH, example_kwargs=_batch()).specs == _auto_specs("phi3").specs


def test_hf_auto_plan_real_gloo():
    cases = [Case(functools.partial(_hf, f), functools.partial(_with_specs, specs=_auto_specs(f).specs), (), {"tp": 2},
                  kwargs=_batch(), name=f"hf {f} auto_plan", **CHECK) for f in ("phi3", "olmo2")]
    check_real_cases(2, cases)


def test_wrong_use_is_a_plan_error():
    model, ids = models.llama(), models.tokens(2, 8, 128)
    with pytest.raises(PlanError, match="not an axis of the mesh"):
        fxshard.auto_plan(model, MESH, (ids,), axis="dp")
    with pytest.raises(PlanError, match="pass vocab=True"):
        fxshard.auto_plan(model, MESH, (ids,), loss_parallel=True, vocab=False)


# ----------------------------------------------------------------------------- what auto_plan leaves whole


class VitAttention(torch.nn.Module):
    """timm's ViT attention, as timm writes it: fused qkv reshaped to (3, heads, head_dim),
    identity q/k norms, dropout modules (fx-traceable: sizes read with ``x.size()``)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.q_norm, self.k_norm = torch.nn.Identity(), torch.nn.Identity()
        self.attn_drop, self.proj_drop = torch.nn.Dropout(0.0), torch.nn.Dropout(0.0)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.size()
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


class VitBlock(torch.nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        nn = torch.nn
        self.norm1, self.attn, self.ls1, self.drop_path1 = nn.LayerNorm(dim), VitAttention(dim), nn.Identity(), nn.Identity()
        self.norm2, self.ls2, self.drop_path2 = nn.LayerNorm(dim), nn.Identity(), nn.Identity()
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.0), nn.Identity(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(0.0))

    def forward(self, x):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class TinyVit(torch.nn.Module):
    def __init__(self, dim=32, patches=8, patch_dim=12, classes=10):
        super().__init__()
        nn = torch.nn
        self.patch_embed = nn.Linear(patch_dim, dim)
        self.pos_embed = nn.Parameter(torch.randn(1, patches, dim) * 0.02)
        self.pos_drop, self.norm_pre = nn.Dropout(0.0), nn.Identity()
        self.blocks = nn.Sequential(VitBlock(dim), VitBlock(dim))
        self.norm, self.fc_norm, self.head_drop = nn.LayerNorm(dim), nn.Identity(), nn.Dropout(0.0)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.norm_pre(self.pos_drop(self.patch_embed(x) + self.pos_embed))
        return self.head(self.head_drop(self.fc_norm(self.norm(self.blocks(x)).mean(1))))


def tiny_vit():
    torch.manual_seed(0)
    return TinyVit()


PATCHES = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(7))


def test_vit_with_identity_leaves_shards_attention_and_mlp_and_says_what_it_left():
    model = tiny_vit()
    plan = fxshard.auto_plan(model, MESH, (PATCHES,), vocab=False)
    assert plan.specs["blocks.*.attn.qkv"].splits == (32, 32, 32)  # the (3, heads, head_dim) view: parts outermost
    assert {"blocks.*.attn.proj", "blocks.*.mlp.0", "blocks.*.mlp.4"} <= set(plan.specs), plan
    assert set(plan.left_whole) == {"patch_embed", "head"}, plan.left_whole
    assert plan.left_whole["head"] == "output projection: vocab=False keeps it replicated"
    assert "feeds blocks.*.attn.qkv" in plan.left_whole["patch_embed"]
    text = repr(plan)
    assert "# left replicated (module: why):" in text and "'head': output projection: vocab=False" in text
    check_simulated(tiny_vit, lambda mesh: Plan(mesh, plan.specs), (PATCHES,), {"tp": 2})


class _OpaqueBetween(torch.nn.Module):
    """A pair whose middle fxshard cannot see inside (nn.Softmax2d does not trace), and a
    parameter-owning leaf with no functional form (nn.PReLU)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.mid, self.fc2, self.act = (torch.nn.Linear(16, 32), torch.nn.Softmax2d(), torch.nn.Linear(32, 16),
                                                  torch.nn.PReLU())

    def forward(self, x):
        return self.act(self.fc2(self.mid(self.fc1(x))))


def test_a_plan_that_would_shard_nothing_is_a_plan_error_with_the_reasons():
    with pytest.raises(PlanError, match="auto_plan found nothing it can shard on 'tp'") as e:
        fxshard.auto_plan(_OpaqueBetween(), MESH, (torch.randn(2, 4, 16),))
    text = str(e.value)
    assert "fc1, fc2: fc1 -> fc2: transform refused every variant: cannot shard node `mid`" in text
    assert "cannot see inside this module call" in text
    assert "act: fxshard cannot see inside it (PReLU" in text and "fix:" in text
    with pytest.raises(PlanError, match="no linear projection and no token embedding"):
        fxshard.auto_plan(torch.nn.Sequential(torch.nn.ReLU()), MESH, (torch.randn(2, 4),))


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_hf_encoder_attention_and_mlp_are_sharded(family):
    transformers = pytest.importorskip("transformers")
    config, cls = {"bert": (transformers.BertConfig, transformers.BertModel),
                   "roberta": (transformers.RobertaConfig, transformers.RobertaModel)}[family]
    torch.manual_seed(0)
    model = cls(config(vocab_size=V, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                       max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    plan = fxshard.auto_plan(model, MESH, example_kwargs={"input_ids": torch.randint(3, V, (2, 8))}, vocab=False)
    layer = "encoder.layer.*."
    for pattern in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"):
        assert plan.specs[layer + pattern] == fxshard.colwise(), (pattern, plan)
    for pattern in ("attention.output.dense", "output.dense"):
        assert plan.specs[layer + pattern] == fxshard.rowwise(), (pattern, plan)
    assert "embeddings.word_embeddings" in plan.left_whole and "embeddings.position_embeddings" in plan.left_whole


class _CheckedVit(TinyVit):
    """timm's VisionTransformer checks its input size in PatchEmbed with ``torch._assert``."""

    def forward(self, x):
        torch._assert(x.shape[1] == 8, "the model takes 8 patches")
        return super().forward(x)


def test_vit_checking_its_input_size_is_planned():
    """The ``torch._assert`` node returns None, so it has no recorded value: every candidate
    transform used to be refused ("this GraphModule has no recorded shapes"), and timm's
    VisionTransformer at tp=2 and tp=4 came back "found nothing it can shard"."""
    for n in (2, 4):
        plan = fxshard.auto_plan(_CheckedVit(), MeshSpec(("tp",), (n,)), (PATCHES,), vocab=False)
        assert {"blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.0", "blocks.*.mlp.4"} <= set(plan.specs), plan


def test_an_internal_error_is_raised_not_counted_as_a_refusal(monkeypatch):
    """A bug inside a pass says nothing about the plan: auto_plan raises it rather than
    picking another plan (or none) without it."""
    import dataclasses
    import importlib

    def broken(gm, ctx):
        raise KeyError("boom")

    module = importlib.import_module("fxshard.transform")  # the module: fxshard.transform is the function
    monkeypatch.setattr(module, "PIPELINE", tuple(dataclasses.replace(p, run=broken) if p.name == "localize" else p
                                                  for p in module.PIPELINE))
    with pytest.raises(fxshard.InternalError, match=r"internal error in pass localize .*KeyError: 'boom'") as e:
        fxshard.auto_plan(tiny_vit(), MESH, (PATCHES,), vocab=False)
    assert not isinstance(e.value, PlanError)
