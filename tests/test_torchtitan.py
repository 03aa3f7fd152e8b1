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
from fxshard.testing.torchtitan_models import tiny_deepseek_v3, tiny_llama3, tiny_qwen3_moe
from fxshard.meta import program_meta

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
    assert program_meta(sharded).captured_by == "torch.export"


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


def dense_deepseek_v3():
    """torchtitan's DeepSeek-V3 cut to its dense first layer: MLA attention, SwiGLU FFN."""
    return tiny_deepseek_v3(n_layers=1)


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "tp-only"])
def test_torchtitan_deepseek_v3_mla_simulated(sp):
    """MLA under torchtitan's plan: ``cat([k_nope, k_pe.expand(-1, -1, n_heads, -1)])``
    with the heads of k_nope sharded; the shared rope key is broadcast to each rank's
    own heads (no value moves) and its gradient summed over the ranks."""
    sharded = check_simulated(dense_deepseek_v3, lambda mesh: fxshard.Plan.from_torchtitan(mesh, dense_deepseek_v3(),
                                                                                          sequence_parallel=sp),
                              (IDS,), {"tp": 2}, loss_fn=cross_entropy, targets=(TGT,), lr=0.5)
    assert ".expand([-1, -1, 2, -1])" in sharded.code  # 4 heads, 2 per rank


@pytest.mark.parametrize("factory, sp", [(tiny_qwen3_moe, True), (tiny_deepseek_v3, False)],
                         ids=["qwen3_moe-sp", "deepseek_v3-tp-only"])
def test_torchtitan_moe_under_tp_simulated(factory, sp):
    """torchtitan's TP-only MoE: ``RoutedExperts`` is its local_map region, the grouped
    experts sharded on their hidden dim, the output each rank's partial sum; shared experts
    colwise/rowwise.  atol 1e-4: torchtitan's experts compute in bfloat16, so each rank's
    partial sum is rounded before the all-reduce adds them."""
    sharded = check_simulated(factory, lambda mesh: fxshard.Plan.from_torchtitan(mesh, factory(), sequence_parallel=sp),
                              (IDS,), {"tp": 2}, loss_fn=cross_entropy, targets=(TGT,), atol=1e-4)
    w1 = next(n for n, _ in sharded.named_parameters() if n.endswith("inner_experts.w1_EFD"))
    assert tuple(sharded.get_parameter(w1).shape) == (4, 16, 64)  # every expert, half of its hidden dim
