"""The planner's FSDP2 bytes for stacked experts with fewer experts per rank than FSDP ranks
(issue 42, item 6): it cuts each parameter where the trainer's ``fxshard.fully_shard`` does
(``fsdp_shard_dim``: an ep rank's ``[E/ep, 2I, H]`` on dim 1 when dp does not divide E/ep).

Before, Mixtral-8x7B at dp=8,ep=8 (64 GPUs) kept each rank's expert whole on one rank of 8:
21.75 GiB of fp32 parameters per rank and the mesh rejected.  The expected figures are counted
here from the configs, not by the planner's arithmetic."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.isolated  # torch's fake process group, process-wide (pyproject: markers)

pytest.importorskip("transformers")

from fxshard.planner import plan_parallelism  # noqa: E402
from test_moe_planner import MIXTRAL_8X7B  # noqa: E402  (Mixtral-8x7B's config.json, one copy)

GIB = 1 << 30
FP32 = 4  # FSDP2's sharded parameters stay fp32 under bf16 mixed precision (it gathers bf16 copies)


def _mixtral_counts(c: dict) -> tuple[int, int]:
    """(expert parameters, the others) of a Mixtral config: experts [E, 2I, H] + [E, H, I] per
    layer; attention q, k, v, o, the router [E, H], two norms per layer; embedding, head, norm."""
    h, i, e, layers = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["num_hidden_layers"]
    head_dim = h // c["num_attention_heads"]
    q = c["num_attention_heads"] * head_dim
    kv = c["num_key_value_heads"] * head_dim
    expert = layers * e * (2 * i * h + h * i)
    per_layer = h * q + 2 * h * kv + q * h + e * h + 2 * h
    dense = layers * per_layer + 2 * c["vocab_size"] * h + h
    return expert, dense


def test_mixtral_8x7b_dp8_ep8_divides_the_experts(tmp_path):
    """dp=8,ep=8 on 64 GPUs, full AC (seq 4096, global batch 256): it fits 80 GiB, and a rank's
    parameters are its 1/64 of the experts (ep=8, each expert's dim 1 over dp=8) and 1/8 of the
    rest (FSDP2 over dp; replicated over ep)."""
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    entry, = plan_parallelism(str(tmp_path), 64, memory_gib=80, seq=4096, global_batch=256, device="h100", dtype="bf16",
                              candidates=[{"dp": 8, "ep": 8, "activation_checkpointing": True}])
    expert, dense = _mixtral_counts(MIXTRAL_8X7B)
    assert 46e9 < expert + dense < 47.5e9  # Mixtral-8x7B: 46.7 billion
    want = FP32 * (expert / 64 + dense / 8)  # 3.37 GiB; a whole expert per rank: 21.75 GiB
    assert abs(entry.memory["params"] - want) <= 0.01 * want, (entry.memory["params"] / GIB, want / GIB)
    assert entry.memory["optimizer"] == pytest.approx(2 * entry.memory["params"])
    assert entry.fits, entry.reason
    assert entry.memory["total"] <= 80 * GIB and entry.tokens_per_s > 100


def test_tiny_mixtral_as_the_trainer_holds(tmp_path):
    """The 2-expert Mixtral of ``tests/training/test_fsdp_experts.py`` at dp=2,ep=2: the
    planner's parameter bytes are those the trainer's ranks hold (that test reads them off
    ``holds:``): half of the dense parameters and a quarter of the experts, exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    from fxshard.testing.hf_tiny import tiny_config

    cfg = tiny_config("mixtral", num_local_experts=2, vocab_size=512)
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    assert (expert, dense) == _mixtral_counts(cfg.to_dict())
    entry, = plan_parallelism(str(tmp_path), 4, memory_gib=80, seq=32, global_batch=8, device="cpu",
                              candidates=[{"dp": 2, "ep": 2}])
    assert entry.memory["params"] == FP32 * (dense // 2 + expert // 4), (entry.memory["params"] / FP32, dense, expert)


def test_mixtral_8x7b_without_recomputation_accumulates_sharded(tmp_path):
    """dp=8,ep=8 without activation checkpointing needs accumulation passes; FSDP2's unsharded
    fp32 gradients held between them (the trainer's default) do not fit 80 GiB, its gradients
    reduce-scattered every pass (``--accum-grads sharded``, torchtitan's) do: the planner picks
    that, says so in the trainer's flags, and counts a reduce-scatter per pass."""
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    kw = dict(memory_gib=80, seq=4096, global_batch=256, device="h100", dtype="bf16")
    mesh = {"dp": 8, "ep": 8, "activation_checkpointing": "none"}
    held, = plan_parallelism(str(tmp_path), 64, candidates=[{**mesh, "accum_grads": "unsharded"}], **kw)
    assert not held.fits and held.memory["grads"] > 5 * held.memory["params"], held.memory
    chosen, = plan_parallelism(str(tmp_path), 64, candidates=[mesh], **kw)
    assert chosen.fits, chosen.reason
    assert chosen.candidate.accum_grads == "sharded" and chosen.accum > 1
    assert chosen.memory["grads"] == chosen.memory["params"]  # only the sharded gradients, 1/64 and 1/8
    assert chosen.trainer_flags().startswith(f"--mesh dp=8,ep=8 --accum {chosen.accum} --accum-grads sharded")
    same, = plan_parallelism(str(tmp_path), 64, candidates=[{**mesh, "accum": chosen.accum}], accum_grads="unsharded",
                             **kw)
    # FSDP2's bytes on dp: the same gathers, and a reduce-scatter of the padded parameters per pass, not per step
    extra = chosen.comm_bytes["dp"] - same.comm_bytes["dp"]
    fsdp_params = chosen.memory["params"] * 8  # the dp group's whole parameters (fp32: FSDP2 reduces in fp32)
    assert extra == pytest.approx((chosen.accum - 1) * fsdp_params, rel=0.02), (extra, fsdp_params)
