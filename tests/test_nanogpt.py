"""nanoGPT (fxshard.testing.nanogpt): Karpathy's model code as written (fused c_attn
split by n_embd, the causal-mask buffer, ``1.0 / math.sqrt(k.size(-1))``, learned
positions from ``torch.arange(0, t, device=idx.device)``, tied wte/lm_head) under
Megatron tensor parallelism: equal to the single-device model."""
import functools

import pytest
import torch

import fxshard
from equivalence import Case, check_real_cases, check_simulated, cross_entropy
from fxshard import MeshSpec, Plan
from fxshard.testing.models import tokens
from fxshard.testing.nanogpt import GPTConfig, nanogpt, nanogpt_plan

V = GPTConfig().vocab_size


# Top-level factories: the real-process checks pickle them.
def make_model():
    return nanogpt(seed=0)


def make_plan(mesh):
    return Plan(mesh, nanogpt_plan("tp"))


def _case(tp, batch=2, seq=8, example=None, **kw):
    ids, tgt = tokens(batch, seq, V, seed=0), tokens(batch, seq, V, seed=1)
    example_inputs = None if example is None else (tokens(*example, V, seed=2),)
    return Case(make_model, make_plan, (ids,), {"tp": tp}, loss_fn=cross_entropy, targets=(tgt,),
                example_inputs=example_inputs, **kw)


def _simulate(case: Case):
    return check_simulated(case.model_factory, case.plan_factory, case.inputs, case.mesh_shape, loss_fn=case.loss_fn,
                           targets=case.targets, example_inputs=case.example_inputs, lr=case.lr)


@pytest.mark.parametrize("tp", [2, 4])
def test_nanogpt_simulated(tp):
    sharded = _simulate(_case(tp))
    # nanoGPT's checkpoint keys are kept; the tied weight stays tied, sharded on the vocab
    keys = set(sharded.state_dict(keep_vars=True))
    assert keys == set(nanogpt().state_dict())
    assert sharded.lm_head.weight is sharded.transformer.wte.weight
    assert sharded.lm_head.weight.shape == (V // tp, GPTConfig().n_embd)


def test_nanogpt_runs_at_other_batch_and_sequence_sizes():
    """Transformed with (1, 4) ids, trained at (2, 8): run-time sizes (B, T, C from
    x.size(), t from idx.size()) stay run-time sizes."""
    _simulate(_case(2, example=(1, 4)))


def test_nanogpt_traced_graph_transforms_without_example_inputs():
    plan = make_plan(MeshSpec(("tp",), (2,)))
    ids = tokens(2, 8, V)
    gm = fxshard.trace(make_model(), plan, example_inputs=(ids,))
    assert fxshard.transform(gm, plan).code == fxshard.transform(make_model(), plan, example_inputs=(ids,)).code


def test_nanogpt_real_tp2():
    check_real_cases(2, [
        _case(2, name="nanogpt tp2"),
        _case(2, example=(1, 4), name="nanogpt tp2, transformed at (1, 4)"),
    ])
