"""Context parallelism: attention over a sequence sharded on a ``cp`` axis.

Equivalence (logits, every parameter gradient, 2 SGD steps) against one device for
fxshard's Llama and GPT-2 and HF Llama, both methods, with and without load
balancing; the mean loss over all tokens; models with their own masks; ``cp x tp``
and ``dp x cp``; and the plans that must be refused.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard import MeshSpec, Plan, PlanError
from fxshard.meta import KEY
from fxshard.testing.models import WithLoss, gpt2, llama, llama_plan, tokens
from equivalence import Case, check_real_cases, check_simulated
from harness import simulated
from fxshard.meta import program_meta

V = 128
IDS = tokens(2, 16, V)


def cp_plan(mesh, method="allgather", lb=True, name="tokens", pattern="layers.*.attention", extra=None, more_inputs=None):
    specs = {pattern: fxshard.context_parallel("cp", method=method, load_balance=lb), **(extra or {})}
    return Plan(mesh, specs, inputs={name: {"cp": Shard(1)}, **(more_inputs or {})})


def gpt2_cp_plan(mesh, method="allgather", lb=True):
    return cp_plan(mesh, method, lb, name="ids", pattern="h.*.attn")


def cp_tp_plan(mesh, method="allgather", lb=True):
    return cp_plan(mesh, method, lb, extra=llama_plan("tp"))


def hf_llama():
    from fxshard.testing.hf_tiny import tiny_model

    return tiny_model("llama")


def hf_cp_plan(mesh, method="allgather", lb=True):
    return cp_plan(mesh, method, lb, name="input_ids", pattern="model.layers.*.self_attn")


def logits(o):
    return o.logits


# ----------------------------------------------------------------------------- equivalence, simulated


@pytest.mark.parametrize("method,lb,cp", [("allgather", True, 2), ("ring", True, 4), ("allgather", False, 4), ("ring", False, 2)])
def test_llama(method, lb, cp):
    sharded = check_simulated(llama, functools.partial(cp_plan, method=method, lb=lb), (IDS,), {"cp": cp})
    assert program_meta(sharded).context_parallel == {"cp": {"method": method, "load_balance": lb}}


@pytest.mark.parametrize("method,lb,cp", [("ring", True, 2), ("allgather", False, 4)])
def test_gpt2_learned_positions(method, lb, cp):
    sharded = check_simulated(gpt2, functools.partial(gpt2_cp_plan, method=method, lb=lb), (IDS,), {"cp": cp})
    assert ("fxshard_local_positions" if lb else "local_offset") in sharded.code  # wpe reads this rank's positions


@pytest.mark.parametrize("method,lb,cp", [("allgather", True, 2), ("ring", False, 4)])
def test_hf_llama(method, lb, cp):
    sharded = check_simulated(hf_llama, functools.partial(hf_cp_plan, method=method, lb=lb), (), {"cp": cp},
                              kwargs={"input_ids": IDS}, select=logits)
    assert "cumsum" not in sharded.code  # HF's packed-sequence search is not captured


@pytest.mark.slow
@pytest.mark.parametrize("method,lb,cp", [("ring", True, 4), ("allgather", False, 4)])
def test_hf_llama_sweep(method, lb, cp):
    check_simulated(hf_llama, functools.partial(hf_cp_plan, method=method, lb=lb), (), {"cp": cp},
                    kwargs={"input_ids": IDS}, select=logits)


def hf_family(family):
    from fxshard.testing.hf_tiny import tiny_model

    return tiny_model(family)


@pytest.mark.parametrize("family,method,lb", [("gemma3_text", "ring", False)])
def test_hf_sliding_window(family, method, lb):
    """Sliding-window layers (window 4 < 16 tokens; Gemma-3 mixes them with full ones, Mistral's
    are all sliding: checked by hand at cp=2, both methods, with and without load balancing):
    one fxshard::sliding_window_mask node, whose rows each rank builds for its positions."""
    sharded = check_simulated(functools.partial(hf_family, family), functools.partial(hf_cp_plan, method=method, lb=lb), (),
                              {"cp": 2}, kwargs={"input_ids": IDS}, select=logits)
    assert "fxshard_sliding_window_rows('cp'" in sharded.code


def test_sliding_window_pattern_is_checked():
    """Only transformers' exact sliding-window function becomes the op; anything else
    (chunked attention, an overlay) keeps transformers' mask (and is refused under CP)."""
    import transformers.masking_utils as mu

    from fxshard.frontend.hf_masks import _is_sliding_window

    assert _is_sliding_window(mu.sliding_window_causal_mask_function(4), 4)
    assert not _is_sliding_window(mu.sliding_window_causal_mask_function(3), 4)
    assert not _is_sliding_window(mu.causal_mask_function, 4)
    assert not _is_sliding_window(mu.sliding_window_bidirectional_mask_function(4), 4)


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_cp_x_tp(method):
    sharded = check_simulated(llama, functools.partial(cp_tp_plan, method=method), (IDS,), {"cp": 2, "tp": 2})
    attn = [n for n in sharded.graph.nodes if n.name.startswith(("scaled_dot_product_attention", "ring_attention"))]
    assert all(n.meta[KEY].value.layout == {"cp": Shard(2), "tp": Shard(1)} for n in attn)


def test_dp_x_cp():
    def plan(mesh):
        return Plan(mesh, {"layers.*.attention": fxshard.context_parallel("cp")}, inputs={"tokens": {"dp": Shard(0), "cp": Shard(1)}})

    check_simulated(llama, plan, (IDS,), {"dp": 2, "cp": 2})


# ----------------------------------------------------------------------------- the loss


def llama_with_loss():
    return WithLoss(llama())


def identity(out):
    return out


def _targets(seed=3):
    t = tokens(1, 16, V, seed=seed)
    t[0, 1:6] = -100  # ignored targets, all on rank 0's part: per-rank means would differ
    return t


@pytest.mark.parametrize("method,lb", [("allgather", True), ("ring", False)])
def test_mean_loss_over_all_tokens(method, lb):
    def plan(mesh):
        return cp_plan(mesh, method, lb, pattern="model.layers.*.attention", more_inputs={"targets": {"cp": Shard(1)}})

    sharded = check_simulated(llama_with_loss, plan, (tokens(1, 16, V), _targets()), {"cp": 2}, loss_fn=identity,
                              replicated_loss=True)
    assert "fxshard_global_mean_cross_entropy" in sharded.code
    summary = fxshard.comm_summary(sharded)
    assert summary.count("forward", "all_reduce", axis="cp") == 2  # the sum of losses and the count


def test_mean_loss_with_loss_parallel():
    def plan(mesh):
        specs = {"model." + k: v for k, v in llama_plan("tp", loss_parallel=True).items()}
        return cp_plan(mesh, "allgather", True, pattern="model.layers.*.attention", extra=specs,
                       more_inputs={"targets": {"cp": Shard(1)}})

    sharded = check_simulated(llama_with_loss, plan, (tokens(1, 16, V), _targets()), {"cp": 2, "tp": 2}, loss_fn=identity,
                              replicated_loss=True)
    assert "mean_axes = ('cp',)" in sharded.code


# ----------------------------------------------------------------------------- models with their own masks


class MaskedAttention(nn.Module):
    """Self-attention taking an explicit mask (boolean or additive), GQA via enable_gqa."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.hd).unbind(2)
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MaskedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MaskedAttention()

    def forward(self, x, mask):
        return x + self.attn(x, mask)


def masked_model():
    torch.manual_seed(0)
    return MaskedModel()


def _mask(kind):
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(2, 1, 16, 16, generator=g) > 0.3
    keep |= torch.eye(16, dtype=torch.bool)  # no row is fully masked
    return keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + 0.1 * torch.randn(keep.shape, generator=g)


@pytest.mark.parametrize("method,lb,kind,mask_layout", [
    ("allgather", True, "bool", Replicate()), ("ring", True, "float", Shard(2)),
    ("allgather", False, "float", Shard(2)), ("ring", False, "bool", Replicate())])
def test_explicit_mask(method, lb, kind, mask_layout):
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))

    def plan(mesh):
        return Plan(mesh, {"attn": fxshard.context_parallel("cp", method=method, load_balance=lb)},
                    inputs={"x": {"cp": Shard(1)}, "mask": {"cp": mask_layout}})

    check_simulated(masked_model, plan, (x, _mask(kind)), {"cp": 2}, lr=0.2)


# ----------------------------------------------------------------------------- helpers and the summary


def test_split_and_gather_sequence():
    x = torch.arange(2 * 8).view(2, 8)
    with simulated({"cp": 2}) as mesh:
        fxshard.bind_mesh(mesh)
        part = fxshard.split_sequence(x, "cp", load_balance=True)
        from harness import plain, rank_value

        assert rank_value(part, 0).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
        assert rank_value(part, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
        back = fxshard.gather_sequence(part.float(), "cp", load_balance=True)
        assert all(torch.equal(rank_value(back, r), x.float()) for r in (0, 1))
        fxshard.bind_mesh(None)


def test_comm_summary_and_dump():
    for method in ("allgather", "ring"):
        sharded = fxshard.transform(llama(), cp_plan(MeshSpec(("cp",), (4,)), method), (IDS,))
        s = fxshard.comm_summary(sharded)
        if method == "allgather":
            # K and V gathered per layer, their gradients reduce-scattered
            assert s.count("forward", "all_gather", axis="cp") == 4 and s.count("backward", "reduce_scatter", axis="cp") == 4
            assert "fxshard_context_parallel_mask" in sharded.code
        else:
            assert s.count("forward", "ring_shift", axis="cp") == 2 * 2 * 3  # K and V, 3 hops, 2 layers
            assert s.count("backward", "ring_shift", axis="cp") == 2 * (4 * 3 + 2)
        assert ("fxshard.ring_attention" if method == "ring" else "fxshard.context_parallel_mask") in fxshard.dump(sharded)
        attn = next(n.name for n in sharded.graph.nodes if n.name.startswith(("scaled_dot_product_attention", "ring_attention")))
        why = fxshard.explain(sharded, attn, axis="cp")
        assert "cp=S(2)" in why and "tokens" in why  # back to the plan's sequence-sharded input


# ----------------------------------------------------------------------------- refusals


def test_refusals():
    mesh = MeshSpec(("cp",), (2,))
    with pytest.raises(PlanError, match=r"divisible by 4.*load_balance=False"):
        fxshard.transform(llama(), cp_plan(mesh), (tokens(2, 6, V),))
    with pytest.raises(PlanError, match=r"declare the module context-parallel on 'cp': \{'h.0.attn'"):
        fxshard.transform(gpt2(), Plan(mesh, {}, inputs={"ids": {"cp": Shard(1)}}), (IDS,))
    with pytest.raises(PlanError, match=r"no scaled_dot_product_attention inside it receives"):
        fxshard.transform(llama(), Plan(mesh, {"layers.*.attention": fxshard.context_parallel()}), (IDS,))
    with pytest.raises(PlanError, match=r"not an axis of the mesh"):
        Plan(mesh, {"layers.*.attention": fxshard.context_parallel("sp")})
    with pytest.raises(PlanError, match=r"same load_balance"):
        Plan(mesh, {"layers.0.attention": fxshard.context_parallel(), "layers.1.attention": fxshard.context_parallel(load_balance=False)})
    with pytest.raises(PlanError, match=r"method"):
        fxshard.context_parallel(method="ulysses")
    # gathering a load-balanced sequence would reorder it
    gather = {"output": fxshard.ModuleSpec(out_src={"cp": Shard(1)}, out_dst={"cp": Replicate()})}
    with pytest.raises(PlanError, match=r"load-balanced"):
        fxshard.transform(llama(), cp_plan(mesh, extra=gather), (IDS,))
    # HF: inputs transformers would build a local mask from
    with pytest.raises(PlanError, match=r"attention_mask"):
        fxshard.transform(hf_llama(), hf_cp_plan(mesh), example_kwargs={"input_ids": IDS, "attention_mask": torch.ones_like(IDS)})


def test_contiguous_gather_of_the_output_is_allowed():
    gather = {"output": fxshard.ModuleSpec(out_src={"cp": Shard(1)}, out_dst={"cp": Replicate()})}
    check_simulated(llama, functools.partial(cp_plan, lb=False, extra=gather), (IDS,), {"cp": 2})


# ----------------------------------------------------------------------------- real gloo ranks


def test_real_gloo():
    cases = [
        Case(llama, functools.partial(cp_plan, method="allgather"), (IDS,), {"cp": 4}, name="llama cp=4 allgather"),
        Case(llama, functools.partial(cp_tp_plan, method="ring"), (IDS,), {"cp": 2, "tp": 2}, name="llama cp x tp ring"),
        Case(hf_llama, functools.partial(hf_cp_plan, method="ring", lb=False), (), {"cp": 4}, kwargs={"input_ids": IDS},
             select=logits, name="hf llama cp=4 ring"),
    ]
    check_real_cases(4, cases)


@pytest.mark.parametrize("kind", ["float", "bool"])
def test_ring_in_row_chunks(monkeypatch, kind):
    """Long sequences run a ring block a chunk of query rows at a time."""
    from fxshard.runtime import context_parallel_ops as cp_ops

    monkeypatch.setattr(cp_ops, "_ROWS", 3)  # 8 local rows: chunks of 3, 3, 2
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))

    def plan(mesh):
        return Plan(mesh, {"attn": fxshard.context_parallel("cp", method="ring")},
                    inputs={"x": {"cp": Shard(1)}, "mask": {"cp": Shard(2)}})

    check_simulated(masked_model, plan, (x, _mask(kind)), {"cp": 2}, lr=0.2)


def test_shard_inputs_cuts_the_sequence_as_the_plan_lays_it_out():
    """fxshard.shard_inputs gives each rank its positions of a dp x cp batch: rows over dp,
    load-balanced sequence chunks (i and 2n-1-i) over cp; the model's logits on them are one
    device's logits at those rows and positions."""
    from harness import plain, rank_value

    ids = tokens(4, 16, V, seed=5)
    model = llama()
    with torch.no_grad():
        want = model(ids)
    with simulated({"dp": 2, "cp": 2}) as mesh:
        plan = cp_plan(mesh).replace(inputs={"tokens": {"dp": Shard(0), "cp": Shard(1)}})
        sharded = fxshard.transform(model, plan, (ids,))
        (mine,), kwargs = fxshard.shard_inputs(sharded, ids)
        assert kwargs == {}
        with torch.no_grad():
            got = sharded(mine)
        with plain():
            per_rank = [(rank_value(mine, r).clone(), rank_value(got, r).clone()) for r in range(4)]
    for r, (ids_r, logits_r) in enumerate(per_rank):
        dp, cp = divmod(r, 2)
        positions = torch.cat([torch.arange(cp * 4, cp * 4 + 4), torch.arange((3 - cp) * 4, (3 - cp) * 4 + 4)])
        rows = slice(2 * dp, 2 * dp + 2)
        assert torch.equal(ids_r, ids[rows][:, positions]), r
        torch.testing.assert_close(logits_r, want[rows][:, positions], rtol=1e-5, atol=1e-5)


def test_shard_inputs_refuses_a_length_the_axis_no_longer_divides():
    """Transformed at a sequence the axis divides, the program assumes equal pieces: a run
    length it does not divide would give rank 1 wrong positions, so shard_inputs refuses it."""
    model = llama()
    with simulated({"cp": 2}) as mesh:
        sharded = fxshard.transform(model, cp_plan(mesh, lb=False), (IDS,))
        with pytest.raises(PlanError, match=r"(?s)'tokens' has 15 along dim 1.*transformed at 16.*pad dim 1 to a multiple of 2"):
            fxshard.shard_inputs(sharded, tokens(2, 15, V))
