"""torchtitan 0.3 Llama3 (fused grouped wqkv, complex rope, GQA), captured with
torch.export and sharded with torchtitan's own TP/SP plans (``Plan.from_torchtitan``):
equal to the single-device model, in simulated ranks and in real gloo processes."""
import functools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan")

import fxshard
from equivalence import Case, check_real_cases, check_simulated, cross_entropy
from fxshard.testing.torchtitan_models import tiny_llama3

V = 128


def llama3(tp: int):
    """tp=4 needs 4 kv heads: torchtitan's plan shards whole kv groups of the fused wqkv."""
    return tiny_llama3(n_heads=8, n_kv_heads=4) if tp == 4 else tiny_llama3()


def titan_plan(mesh, tp, **kw):
    return fxshard.Plan.from_torchtitan(mesh, llama3(tp), **kw)


def vocab_parallel_loss(logits, targets):
    """Cross-entropy of full logits on one device, of vocab-sharded logits on a rank."""
    if logits.shape[-1] == V:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    return fxshard.vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), "tp")


def _data(b=2, s=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, s), generator=g), torch.randint(0, V, (b, s), generator=g)


IDS, TGT = _data()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "tp-only"])
def test_torchtitan_llama3_simulated(tp, sp):
    sharded = check_simulated(functools.partial(llama3, tp), functools.partial(titan_plan, tp=tp, sequence_parallel=sp),
                              (IDS,), {"tp": tp}, loss_fn=cross_entropy, targets=(TGT,), lr=0.5)
    assert sharded.meta["captured_by"] == "torch.export"


def test_torchtitan_llama3_loss_parallel_simulated():
    sharded = check_simulated(functools.partial(llama3, 2), functools.partial(titan_plan, tp=2, loss_parallel=True),
                              (IDS,), {"tp": 2}, loss_fn=vocab_parallel_loss, targets=(TGT,), replicated_loss=True, lr=0.5)
    out = [n for n in sharded.graph.nodes if n.op == "output"][0].args[0][0]
    assert tuple(out.meta["fxshard"].value.local_shape) == (2, 8, V // 2)  # logits never gathered


def test_torchtitan_llama3_other_sizes_simulated():
    ids, tgt = _data(3, 6, seed=1)
    check_simulated(functools.partial(llama3, 2), functools.partial(titan_plan, tp=2), (ids,), {"tp": 2},
                    loss_fn=cross_entropy, targets=(tgt,), example_inputs=(IDS,), lr=0.5)


def test_torchtitan_llama3_real_gloo():
    check_real_cases(2, [
        Case(functools.partial(llama3, 2), functools.partial(titan_plan, tp=2), (IDS,), {"tp": 2},
             loss_fn=cross_entropy, targets=(TGT,), lr=0.5, name="torchtitan llama3 tp+sp"),
        Case(functools.partial(llama3, 2), functools.partial(titan_plan, tp=2, loss_parallel=True), (IDS,), {"tp": 2},
             loss_fn=vocab_parallel_loss, targets=(TGT,), replicated_loss=True, lr=0.5, name="torchtitan llama3 loss parallel"),
    ])
