"""HF transformers MoE models (experts stacked as 3-D weights, called with the routing)
sharded with their own plans (``Plan.from_hf``): expert parallelism over ``ep``, tensor
parallelism inside the experts over ``tp``, and both.  Logits, the model's own loss,
every gradient (router and experts included) and the outputs after 2 SGD steps equal the
single-device model, in simulated ranks and in real gloo processes."""
import functools

import pytest
import torch
from torch.distributed.tensor import Shard

pytest.importorskip("transformers")

import fxshard
from equivalence import Case, check_real_cases, check_simulated
from fxshard.testing.hf_tiny import tiny_inputs, tiny_model

IDS, LABELS = tiny_inputs()  # [2, 8]: 16 tokens, 4 experts, top-2
BATCH = {"input_ids": IDS, "labels": LABELS}


def logits(out):
    return out.logits


def model_loss(out):
    return out.loss


CHECK = dict(kwargs=BATCH, select=logits, loss_fn=model_loss, replicated_loss=True, lr=0.2)  # picklable: real ranks


def moe_model(family: str, starve: int | None = None):
    """The tiny model; ``starve=r``: rank ``r``'s experts (of an ep=2 split) are never
    chosen (DeepSeek-V3's selection bias), so that rank's experts see zero tokens."""
    model = tiny_model(family)
    if starve is not None:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("gate.e_score_correction_bias"):
                    half = b.numel() // 2
                    b[starve * half:(starve + 1) * half] = -100.0
    return model


def hf_plan(mesh, family: str, starve: int | None = None):
    return fxshard.Plan.from_hf(mesh, moe_model(family, starve))


def _case(family: str, mesh_shape: dict, starve: int | None = None, **kw) -> Case:
    return Case(functools.partial(moe_model, family, starve), functools.partial(hf_plan, family=family, starve=starve), (),
                mesh_shape, name=f"{family} {mesh_shape}", **{**CHECK, **kw})


@pytest.mark.parametrize("family, mesh_shape", [
    ("mixtral", {"ep": 2}),
    ("mixtral", {"tp": 2}),
    ("qwen3_moe", {"ep": 2, "tp": 2}),
    ("qwen2_moe", {"ep": 2}),        # shared expert and its sigmoid gate
    ("deepseek_v3", {"ep": 2}),      # grouped top-k router with selection bias, shared experts, dense first layer
])
def test_hf_moe_simulated(family, mesh_shape):
    sharded = check_simulated(functools.partial(moe_model, family), functools.partial(hf_plan, family=family), (),
                              mesh_shape, **CHECK)
    calls = [n for n in sharded.graph.nodes if n.op == "call_module" and n.target.endswith("mlp.experts")]
    assert calls, "the experts are one call each, run on local tensors"


def test_mla_attention_under_tp():
    """DeepSeek-V2's MLA under HF's plan: the per-head keys are assembled in a new buffer
    from the head-sharded no-rope part and the shared rope key broadcast to every head
    (``k_rot.expand(-1, n_heads, -1, -1)``).  The buffer is built sharded like its parts,
    each rank broadcasts the shared key to its own heads only, and that key's gradient
    is summed over the ranks: one all-reduce of [B, 1, S, rope] per layer backward."""
    sharded = check_simulated(functools.partial(moe_model, "deepseek_v2"), functools.partial(hf_plan, family="deepseek_v2"),
                              (), {"tp": 2}, **CHECK)
    code = sharded.code
    assert "new_empty" in code and ".expand([-1, 2, -1, -1])" in code  # 4 heads, 2 per rank
    syncs = [n for n in sharded.graph.nodes if n.op == "call_function" and n.target is fxshard.grad_sync
             and any(u.op == "call_method" and u.target == "expand" for u in n.users)]
    assert len(syncs) == 2, [n.name for n in syncs]  # the shared rope key of each layer


def _batch_sharded_plan(mesh):
    return fxshard.Plan(mesh, {"model.layers.*.mlp.experts": fxshard.routed_experts(ep="ep", tokens=Shard(0))},
                        inputs={"input_ids": {"ep": Shard(0)}})


@pytest.mark.parametrize("family", ["qwen2_moe"])
def test_batch_sharded_over_ep(family):
    """Each ep rank holds its own sequences (attention, mask and positions of its batch);
    the experts all-gather the tokens and routing and reduce-scatter their shares back."""
    sharded = check_simulated(functools.partial(moe_model, family), _batch_sharded_plan, (), {"ep": 2},
                              kwargs={"input_ids": IDS}, select=logits)
    kinds = {r.kind for r in fxshard.comm_summary(sharded).rows if r.phase == "forward"}
    assert kinds == {"all_gather", "reduce_scatter"}, kinds


def test_zero_token_experts():
    """Every token routes past rank 1's experts: they compute nothing, get zero gradients,
    and the all-reduce still sums the right output."""
    model = moe_model("deepseek_v3", starve=1)
    gate = next(m for n, m in model.named_modules() if n.endswith("mlp.gate"))
    _, _, idx = gate(torch.randn(16, model.config.hidden_size))
    assert bool((idx < 2).all()), "the bias keeps experts 2 and 3 unchosen"
    check_simulated(functools.partial(moe_model, "deepseek_v3", 1), functools.partial(hf_plan, family="deepseek_v3", starve=1),
                    (), {"ep": 2}, **CHECK)


def test_full_state_dict_holds_every_expert():
    """``full_state_dict`` gathers the stacked experts over ep and their packed halves
    over tp; ``load_full_state_dict`` puts each rank's slice back."""
    from harness import simulated

    model = moe_model("mixtral")
    with simulated({"ep": 2, "tp": 2}) as mesh:
        sharded = fxshard.transform(model, fxshard.Plan.from_hf(mesh, model), example_kwargs=BATCH)
        local = sharded.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
        e, two_i, h = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj").shape
        assert tuple(local.shape) == (e // 2, two_i // 2, h)  # 2 of 4 experts, half of gate and half of up
        full = fxshard.full_state_dict(sharded)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=0, atol=0, msg=k)
        with torch.no_grad():
            local.zero_()
        fxshard.load_full_state_dict(sharded, model.state_dict())
        torch.testing.assert_close(fxshard.full_state_dict(sharded)["model.layers.0.mlp.experts.gate_up_proj"],
                                   model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"], rtol=0, atol=0)


IDS4, LABELS4 = tiny_inputs(batch=4)  # 4 sequences: one or two per ep rank


def dispatch_plan(mesh, tp: str | None = None):
    """The batch sharded over ep; tokens sent to their experts' ranks with all-to-alls."""
    spec = fxshard.routed_experts(ep="ep", tp=tp, tokens=Shard(0), dispatch="all_to_all")
    return fxshard.Plan(mesh, {"model.layers.*.mlp.experts": spec}, inputs={"input_ids": {"ep": Shard(0)}})


def _dispatch_case(family: str, mesh_shape: dict, starve: int | None = None, **kw) -> Case:
    plan = functools.partial(dispatch_plan, tp="tp" if "tp" in mesh_shape else None)
    return Case(functools.partial(moe_model, family, starve), plan, (), mesh_shape, kwargs={"input_ids": IDS4},
                select=logits, name=f"{family} {mesh_shape} all-to-all dispatch", **kw)


def _count_all_to_alls(sharded, mesh, rank, world_size):
    """Per MoE layer: count exchange, dispatch and combine forward, the dispatch's and
    combine's mirror backward; no all-gather or reduce-scatter of the tokens."""
    from test_moe import CountAllToAll

    layers = sum(1 for n, _ in sharded.named_modules() if n.endswith("mlp.experts"))
    with CountAllToAll() as fwd:
        out = sharded(input_ids=IDS4.chunk(world_size)[rank])
    with CountAllToAll() as bwd:
        out.logits.pow(2).mean().backward()
    assert (fwd.calls, bwd.calls) == (3 * layers, 2 * layers), (fwd.calls, bwd.calls)
    assert fxshard.comm_summary(sharded).count("forward", "all_gather") == 0


def test_hf_moe_real_gloo_ep2():
    """2 gloo ranks: Mixtral and Qwen3-MoE at ep=2 with HF's plan (tokens replicated);
    Qwen3-MoE and DeepSeek-V3 (rank 1's experts never chosen) with the batch sharded over
    ep and the tokens dispatched to their experts' ranks."""
    check_real_cases(2, [_case("mixtral", {"ep": 2}), _case("qwen3_moe", {"ep": 2}), _dispatch_case("qwen3_moe", {"ep": 2}),
                         _dispatch_case("deepseek_v3", {"ep": 2}, starve=1, post=_count_all_to_alls)])


def test_hf_moe_real_gloo():
    """One spawn of 4 gloo ranks: Mixtral at ep x tp = 2 x 2 with HF's plan, Qwen3-MoE at
    2 x 2 dispatching its batch-sharded tokens, DeepSeek-V3 (shared experts) at ep=4 with
    two ranks' experts never chosen.  (Qwen3-MoE at 2 x 2 with HF's plan: simulated above.)"""
    check_real_cases(4, [_case("mixtral", {"ep": 2, "tp": 2}), _dispatch_case("qwen3_moe", {"ep": 2, "tp": 2}),
                         _case("deepseek_v3", {"ep": 4}, starve=1)])


def test_all_to_all_dispatch_needs_sharded_tokens():
    with pytest.raises(fxshard.PlanError, match=r"dispatch='all_to_all'.* needs tokens=Shard\(0\)"):
        fxshard.routed_experts(ep="ep", dispatch="all_to_all")
