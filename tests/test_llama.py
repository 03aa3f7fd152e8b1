"""Llama (RMSNorm, rotary, GQA, SwiGLU, no biases) under Megatron tensor parallelism.

Every check compares the sharded program with the single-device model: output,
parameter gradients (each rank's shard against the matching slice) and outputs after
two SGD steps, with token-level cross-entropy computed outside the graph from the
sharded logits.  ``n_heads=8, n_kv_heads=4`` so that tp=4 divides the kv heads.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode

import fxshard
from fxshard import MeshSpec, Plan
from fxshard.testing.models import llama, llama_plan, tokens

from equivalence import Case, check_real_cases, check_simulated, cross_entropy
from harness import simulated

VOCAB = 128
IDS, TARGETS = tokens(2, 8, VOCAB, seed=1), tokens(2, 8, VOCAB, seed=2)
IDS4, TARGETS4 = tokens(4, 8, VOCAB, seed=3), tokens(4, 8, VOCAB, seed=4)
# other batch size and sequence length than the example inputs
IDS_OTHER, TARGETS_OTHER = tokens(3, 5, VOCAB, seed=5), tokens(3, 5, VOCAB, seed=6)


# Top-level factories: check_real pickles them into the spawned ranks.
make_llama = functools.partial(llama, seed=0, n_heads=8, n_kv_heads=4)


def tp_plan(mesh):
    return Plan(mesh, llama_plan("tp"))


def dp_tp_plan(mesh):
    return Plan(mesh, llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}})


def ce_case(model, plan, ids, targets, mesh_shape, **kw) -> Case:
    return Case(model, plan, (ids,), mesh_shape, loss_fn=cross_entropy, targets=(targets,), **kw)


# ----------------------------------------------------------------------------- simulated ranks


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_simulated(tp):
    check_simulated(make_llama, tp_plan, (IDS,), {"tp": tp}, loss_fn=cross_entropy, targets=(TARGETS,))


@pytest.mark.parametrize("rope", ["complex", "real"])
@pytest.mark.parametrize("norm", ["module", "written"])
def test_rope_and_norm_variants_simulated(rope, norm):
    """nn.RMSNorm (a leaf module, normalized to F.rms_norm) and the written-out norm;
    complex (view_as_complex) and real (rotate-half) rotary embeddings."""
    model = functools.partial(make_llama, rope=rope, norm=norm)
    check_simulated(model, tp_plan, (IDS,), {"tp": 4}, loss_fn=cross_entropy, targets=(TARGETS,))


@pytest.mark.parametrize("rope", ["complex", "real"])
def test_other_batch_and_seqlen_simulated(rope):
    """Transformed at [2, 8], run at [3, 5]: sizes read at run time stay symbolic."""
    check_simulated(functools.partial(make_llama, rope=rope), tp_plan, (IDS_OTHER,), {"tp": 4},
                    loss_fn=cross_entropy, targets=(TARGETS_OTHER,), example_inputs=(IDS,))


def test_dp_tp_simulated():
    """dp x tp = 2 x 2, batch sharded on dp: the objective is the SUM of the per-rank
    losses (each a mean over its half of the batch), gradients are summed over dp."""
    sharded = check_simulated(make_llama, dp_tp_plan, (IDS4,), {"dp": 2, "tp": 2},
                              loss_fn=cross_entropy, targets=(TARGETS4,))
    buckets = [n for n in sharded.graph.nodes if n.target is fxshard.grad_sync_bucket and n.args[1] == "dp"]
    assert len(buckets) == 1, "replicated parameters under a batch-sharded axis need a grad sync on dp (one bucket)"


@pytest.mark.filterwarnings("ignore:Full backward hook")  # CommDebugMode's module hooks
def test_collectives_per_layer_simulated():
    """Megatron's count: 2 all-reduces forward and 2 backward per layer, nothing else."""
    for n_layers in (1, 3):
        model = make_llama(n_layers=n_layers)
        with simulated({"tp": 2}) as mesh:
            sharded = fxshard.transform(model, tp_plan(mesh), (IDS,))
            fwd, bwd = _comm_counts(sharded, IDS, TARGETS)
        assert fwd == {"all_reduce": 2 * n_layers}, (n_layers, fwd)
        assert bwd == {"all_reduce": 2 * n_layers}, (n_layers, bwd)


def _comm_counts(sharded, ids, targets) -> tuple[dict, dict]:
    """Collectives of one forward (loss included) and of its backward, by op name."""
    def names(mode):
        return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}

    with CommDebugMode() as fwd:
        loss = cross_entropy(sharded(ids), targets)
    with CommDebugMode() as bwd:
        loss.backward()
    return names(fwd), names(bwd)


# ----------------------------------------------------------------------------- offline


def test_code_is_the_same_for_every_rank_offline():
    """The generated code does not depend on the rank: rank-dependent values live in
    the local parameter shards only."""
    model = make_llama()
    codes, wq = [], []
    for c in range(4):
        sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (4,), coordinate=(c,)), llama_plan("tp")), (IDS,))
        codes.append(sharded.code)
        wq.append(sharded.get_parameter("layers.0.attention.wq.weight"))
    assert all(code == codes[0] for code in codes)
    full = model.layers[0].attention.wq.weight
    for c in range(4):
        torch.testing.assert_close(wq[c], full[c * 16:(c + 1) * 16], rtol=0, atol=0)


def test_transform_does_not_change_the_model():
    model = make_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ----------------------------------------------------------------------------- real ranks


def _code_and_comms(sharded, mesh, rank, world_size, *, n_layers, ids, targets):
    """Real ranks: the generated code is the same string on every rank, and one
    training step has Megatron's collective count."""
    codes = [None] * world_size
    dist.all_gather_object(codes, sharded.code)
    assert all(c == codes[0] for c in codes), f"rank {rank}: generated code differs between ranks"
    if ids is not None:
        fwd, bwd = _comm_counts(sharded, ids, targets)
        assert fwd == {"all_reduce": 2 * n_layers} and bwd == {"all_reduce": 2 * n_layers}, (fwd, bwd)


def test_tp2_real():
    """tp=2 on 2 gloo processes: complex rope + nn.RMSNorm; real rope + written norm
    at another batch size / sequence length than the example inputs."""
    post = functools.partial(_code_and_comms, n_layers=2, ids=IDS, targets=TARGETS)
    check_real_cases(2, [
        ce_case(make_llama, tp_plan, IDS, TARGETS, {"tp": 2}, post=post, name="tp=2"),
        ce_case(functools.partial(make_llama, rope="real", norm="written"), tp_plan, IDS_OTHER, TARGETS_OTHER,
                {"tp": 2}, example_inputs=(IDS,), name="tp=2 real rope, written norm, other shape"),
    ])


def test_tp4_and_dp_tp_real():
    """tp=4 and dp x tp = 2 x 2 (batch sharded on dp) on 4 gloo processes."""
    check_real_cases(4, [
        ce_case(make_llama, tp_plan, IDS, TARGETS, {"tp": 4},
                post=functools.partial(_code_and_comms, n_layers=2, ids=IDS, targets=TARGETS), name="tp=4"),
        ce_case(make_llama, dp_tp_plan, IDS4, TARGETS4, {"dp": 2, "tp": 2},
                post=functools.partial(_code_and_comms, n_layers=2, ids=None, targets=None), name="dp=2 x tp=2"),
    ])
