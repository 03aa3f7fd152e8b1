"""Sequence parallelism: collectives per layer equal Megatron's, gradients exact."""
import collections

import pytest
from expecttest import TestCase

import fxshard
from fxshard import MeshSpec, Plan
from fxshard.runtime import collectives as runtime
from fxshard.meta import KEY
from fxshard.testing.models import WithLoss, gpt2, gpt2_plan, llama, llama_plan, tokens
from harness import simulated

V = 128


def _static(gm, prefix):
    """Forward and backward collective kinds of the nodes under module ``prefix``."""
    from fxshard.debug.graph_walk import module_path

    fwd, bwd = collections.Counter(), collections.Counter()
    for n in gm.graph.nodes:
        meta = n.meta.get(KEY)
        if meta is None or meta.collective is None or not (module_path(n) + ".").startswith(prefix + "."):
            continue
        c = meta.collective
        if c.fwd not in ("identity", "local chunk"):
            fwd[c.fwd] += 1
        if c.bwd not in ("identity", "local chunk"):
            bwd[c.bwd.split(" (")[0]] += 1
    return fwd, bwd


def _plan(model_kind, sp):
    if model_kind == "llama":
        return {"model." + k: v for k, v in llama_plan(sequence_parallel=sp, loss_parallel=True).items()}
    return {"model." + k: v for k, v in gpt2_plan(sequence_parallel=sp, loss_parallel=True).items()}


def _model(kind):
    return WithLoss(llama(n_heads=8, n_kv_heads=4) if kind == "llama" else gpt2())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_collectives_per_layer(kind):
    ids, tgt = tokens(2, 8, V), tokens(2, 8, V, seed=1)
    layers = "model.layers" if kind == "llama" else "model.h"
    for sp in (False, True):
        gm = fxshard.transform(_model(kind), Plan(MeshSpec(("tp",), (2,)), _plan(kind, sp)), (ids, tgt))
        summary = fxshard.comm_summary(gm)
        for i in range(2):
            fwd, bwd = _static(gm, f"{layers}.{i}")
            if sp:  # Megatron-SP: 2 all-gathers + 2 reduce-scatters forward; backward the same, and the
                # inputs of the column-parallel linears gathered again (their shards are what is kept)
                rows = {p: collections.Counter(r.kind for r in summary.select(p, region=f"{layers}.{i}"))
                        for p in ("forward", "backward")}
                fused = sum(r.op == "gathered_linears" for r in summary.select("forward", region=f"{layers}.{i}"))
                assert fused == 2, (kind, i, fused)  # q|k|v (GPT-2: c_attn) and the MLP's up (and gate)
                assert rows["forward"] == {"all_gather": 2, "reduce_scatter": 2}, (kind, i, rows)
                assert rows["backward"] == {"all_gather": 2 + fused, "reduce_scatter": 2}, (kind, i, rows)
            else:
                assert fwd == {"all-reduce": 2} and bwd == {"all-reduce": 2}, (kind, i, fwd, bwd)
        if sp:  # the sequence-parallel norms' weights (GPT-2: also LayerNorm biases and the two row-parallel
            # biases added to shards) have their gradients all-reduced together: one bucket for the model
            (bucket,) = [r for r in fxshard.comm_summary(gm).rows if r.op == "grad_sync_bucket"]
            per_layer = 2 if kind == "llama" else 6
            assert bucket.shape == ((2 * per_layer + (1 if kind == "llama" else 2)) * 64,)


class _Counter:
    def __init__(self, monkeypatch):
        self.calls = collections.Counter()
        for name in ("raw_all_reduce", "raw_all_gather", "raw_reduce_scatter"):
            orig = getattr(runtime, name)
            monkeypatch.setattr(runtime, name, self._wrap(name, orig))

    def _wrap(self, name, fn):
        def counted(*a, **k):
            self.calls[name[4:]] += 1
            return fn(*a, **k)
        return counted


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_runtime_counts_match_graph(kind, monkeypatch):
    """What runs equals what the graph says: per step, the layers' collectives plus the
    embedding's reduction, the head's gather and the loss's scalar-per-token reductions."""
    ids, tgt = tokens(2, 8, V), tokens(2, 8, V, seed=1)
    model = _model(kind)  # built outside the simulation: inside it, factories make per-rank tensors
    with simulated({"tp": 2}) as mesh:
        gm = fxshard.transform(model, Plan(mesh, _plan(kind, True)), (ids, tgt))
        summary = fxshard.comm_summary(gm)
        counter = _Counter(monkeypatch)
        loss = gm(ids, tgt)
        fwd = dict(counter.calls)
        counter.calls.clear()
        loss.backward()
        bwd = dict(counter.calls)
    # the summary lists the loss's three scalar-per-token all-reduces (max, sum-exp, target logit)
    # and, per gathered_linears call, its gather forward, its gather again and its reduce-scatter backward
    assert summary.count("forward", "all_reduce", region="") == 3
    assert summary.count("backward", "all_gather") > summary.count("forward", "reduce_scatter")
    assert fwd == dict(collections.Counter(r.kind for r in summary.forward)), (fwd, summary)
    assert bwd == dict(collections.Counter(r.kind for r in summary.backward)), (bwd, summary)


class TestGoldenDumps(TestCase):
    def test_gpt2_layer_sequence_parallel(self):
        ids, tgt = tokens(2, 8, V), tokens(2, 8, V, seed=1)
        gm = fxshard.transform(_model("gpt2"), Plan(MeshSpec(("tp",), (2,)), _plan("gpt2", True)), (ids, tgt))
        self.assertExpectedInline(fxshard.dump(gm, region="model.h.0.*", source=False), """\
fxshard dump of WithLoss  mesh: tp=2  nodes: 43  collectives: 12 (all_gather@tp x1, gathered_linears@tp x4, grad_sync_bucket@tp x1, reduce_scatter@tp x5, shard@tp x1)
communication per step: forward 13 (40.2 KiB)  backward 16 (61.5 KiB)
   node                          op             target                                                                              tp                local                             global                            dtype    module
   model_h_0_ln_1_weight         get_attr       model.h.0.ln_1.weight                                                               R                 [64]                              [64]                              float32  model.h.0.ln_1
   model_h_0_ln_1_bias           get_attr       model.h.0.ln_1.bias                                                                 R                 [64]                              [64]                              float32  model.h.0.ln_1
   model_h_0_mlp_c_proj_bias     get_attr       model.h.0.mlp.c_proj.bias                                                           R                 [64]                              [64]                              float32  model.h.0.mlp.c_proj
   model_h_0_ln_2_weight         get_attr       model.h.0.ln_2.weight                                                               R                 [64]                              [64]                              float32  model.h.0.ln_2
   model_h_0_ln_2_bias           get_attr       model.h.0.ln_2.bias                                                                 R                 [64]                              [64]                              float32  model.h.0.ln_2
   model_h_0_attn_c_proj_bias    get_attr       model.h.0.attn.c_proj.bias                                                          R                 [64]                              [64]                              float32  model.h.0.attn.c_proj
   layer_norm                    call_function  F.layer_norm                                                                        S(1)              [2, 4, 64]                        [2, 8, 64]                        float32  model.h.0.ln_1
   model_h_0_attn_c_attn_weight  get_attr       model.h.0.attn.c_attn.weight                                                        S(0)              [96, 64]                          [192, 64]                         float32  model.h.0.attn.c_attn
   model_h_0_attn_c_attn_bias    get_attr       model.h.0.attn.c_attn.bias                                                          S(0)              [96]                              [192]                             float32  model.h.0.attn.c_attn
>> gathered_linears              call_function  fxshard.gathered_linears  [fwd all-gather | bwd all-gather again + reduce-scatter]  (S(2))            [2, 8, 96]                        [2, 8, 192]                       float32  model.h.0.attn
   c_attn                        call_function  operator.getitem                                                                    S(2)              [2, 8, 96]                        [2, 8, 192]                       float32  model.h.0.attn.c_attn
   getattr_3                     call_function  builtins.getattr                                                                                      int                               (2, 8, 64)                                 model.h.0.attn
   getitem_2                     call_function  operator.getitem                                                                                      int                               2                                          model.h.0.attn
   getitem_3                     call_function  operator.getitem                                                                                      int                               8                                          model.h.0.attn
   split                         call_method    Tensor.split                                                                        (S(2),S(2),S(2))  [2, 8, 32] [2, 8, 32] [2, 8, 32]  [2, 8, 64] [2, 8, 64] [2, 8, 64]  float32  model.h.0.attn
   getitem_5                     call_function  operator.getitem                                                                    S(2)              [2, 8, 32]                        [2, 8, 64]                        float32  model.h.0.attn
   getitem_6                     call_function  operator.getitem                                                                    S(2)              [2, 8, 32]                        [2, 8, 64]                        float32  model.h.0.attn
   getitem_7                     call_function  operator.getitem                                                                    S(2)              [2, 8, 32]                        [2, 8, 64]                        float32  model.h.0.attn
   view                          call_method    Tensor.view                                                                         S(2)              [2, 8, 2, 16]                     [2, 8, 4, 16]                     float32  model.h.0.attn
   transpose                     call_method    Tensor.transpose                                                                    S(1)              [2, 2, 8, 16]                     [2, 4, 8, 16]                     float32  model.h.0.attn
   view_1                        call_method    Tensor.view                                                                         S(2)              [2, 8, 2, 16]                     [2, 8, 4, 16]                     float32  model.h.0.attn
   transpose_1                   call_method    Tensor.transpose                                                                    S(1)              [2, 2, 8, 16]                     [2, 4, 8, 16]                     float32  model.h.0.attn
   view_2                        call_method    Tensor.view                                                                         S(2)              [2, 8, 2, 16]                     [2, 8, 4, 16]                     float32  model.h.0.attn
   transpose_2                   call_method    Tensor.transpose                                                                    S(1)              [2, 2, 8, 16]                     [2, 4, 8, 16]                     float32  model.h.0.attn
   scaled_dot_product_attention  call_function  F.scaled_dot_product_attention                                                      S(1)              [2, 2, 8, 16]                     [2, 4, 8, 16]                     float32  model.h.0.attn
   transpose_3                   call_method    Tensor.transpose                                                                    S(2)              [2, 8, 2, 16]                     [2, 8, 4, 16]                     float32  model.h.0.attn
   reshape                       call_method    Tensor.reshape                                                                      S(2)              [2, 8, 32]                        [2, 8, 64]                        float32  model.h.0.attn
   model_h_0_attn_c_proj_weight  get_attr       model.h.0.attn.c_proj.weight                                                        S(1)              [64, 32]                          [64, 64]                          float32  model.h.0.attn.c_proj
   linear_1                      call_function  F.linear                                                                            P                 [2, 8, 64]                        [2, 8, 64]                        float32  model.h.0.attn.c_proj
>> reduce_scatter_1              call_function  fxshard.reduce_scatter  [fwd reduce-scatter | bwd all-gather]                       S(1)              [2, 4, 64]                        [2, 8, 64]                        float32  model.h.0.attn.c_proj
   add_5                         call_function  operator.add                                                                        S(1)              [2, 4, 64]                        [2, 8, 64]                        float32  model.h.0.attn.c_proj
   add_1                         call_function  operator.add                                                                        S(1)              [2, 4, 64]                        [2, 8, 64]                        float32  model.h.0
   layer_norm_1                  call_function  F.layer_norm                                                                        S(1)              [2, 4, 64]                        [2, 8, 64]                        float32  model.h.0.ln_2
   model_h_0_mlp_c_fc_weight     get_attr       model.h.0.mlp.c_fc.weight                                                           S(0)              [128, 64]                         [256, 64]                         float32  model.h.0.mlp.c_fc
   model_h_0_mlp_c_fc_bias       get_attr       model.h.0.mlp.c_fc.bias                                                             S(0)              [128]                             [256]                             float32  model.h.0.mlp.c_fc
>> gathered_linears_1            call_function  fxshard.gathered_linears  [fwd all-gather | bwd all-gather again + reduce-scatter]  (S(2))            [2, 8, 128]                       [2, 8, 256]                       float32  model.h.0.mlp
   c_fc                          call_function  operator.getitem                                                                    S(2)              [2, 8, 128]                       [2, 8, 256]                       float32  model.h.0.mlp.c_fc
   gelu                          call_function  F.gelu                                                                              S(2)              [2, 8, 128]                       [2, 8, 256]                       float32  model.h.0.mlp
   model_h_0_mlp_c_proj_weight   get_attr       model.h.0.mlp.c_proj.weight                                                         S(1)              [64, 128]                         [64, 256]                         float32  model.h.0.mlp.c_proj
   linear_3                      call_function  F.linear                                                                            P                 [2, 8, 64]                        [2, 8, 64]                        float32  model.h.0.mlp.c_proj
>> reduce_scatter_2              call_function  fxshard.reduce_scatter  [fwd reduce-scatter | bwd all-gather]                       S(1)              [2, 4, 64]                        [2, 8, 64]                        float32  model.h.0.mlp.c_proj
   add_6                         call_function  operator.add                                                                        S(1)              [2, 4, 64]                        [2, 8, 64]                        float32  model.h.0.mlp.c_proj
   add_2                         call_function  operator.add                                                                        S(1)              [2, 4, 64]                        [2, 8, 64]                        float32  model.h.0""")

    def test_loss_parallel_head(self):
        ids, tgt = tokens(2, 8, V), tokens(2, 8, V, seed=1)
        gm = fxshard.transform(_model("llama"), Plan(MeshSpec(("tp",), (2,)), _plan("llama", False)), (ids, tgt))
        self.assertExpectedInline(fxshard.dump(gm, region="model.output", source=False), """\
fxshard dump of WithLoss  mesh: tp=2  nodes: 3  collectives: 9 (all_reduce@tp x4, grad_sync@tp x5)
communication per step: forward 7 (16.2 KiB)  backward 5 (20.0 KiB)
   node                 op             target                                              tp    local       global       dtype    module
   model_output_weight  get_attr       model.output.weight                                 S(0)  [64, 64]    [128, 64]    float32  model.output
>> grad_sync_4          call_function  fxshard.grad_sync  [fwd identity | bwd all-reduce]  R     [2, 8, 64]  [2, 8, 64]   float32  model.output
   linear_14            call_function  F.linear                                            S(2)  [2, 8, 64]  [2, 8, 128]  float32  model.output""")
