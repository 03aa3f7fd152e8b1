"""fxshard TP + FSDP2 over ``dp`` on 4 gloo ranks (``dp x tp = 2 x 2``).

Each run trains 2 AdamW steps on the global batch, each dp rank on its half, and
checks the per-step losses (mean over dp ranks) and the full parameters after the
steps against one device, and -- for fxshard's Llama -- against torchtitan-style
DTensor TP (``parallelize_module``) + FSDP2 in the same processes.  Also: the
per-rank bytes of parameters, gradients and optimizer state, mixed precision, and
the errors of a wrong setup.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

import fxshard
from fxshard import MeshSpec, Plan, PlanError
from fxshard.testing.models import llama, llama_plan

from harness import make_mesh, spawn
from fxshard.meta import program_meta

B, S, V = 4, 8, 128
STEPS = 2
LR = 1e-3  # AdamW normalizes: a gradient near 0 moves its weight by ~lr whatever its rounding


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def _one_device(model, ids, targets, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _train_local(model, ids, targets, dp_group, steps=STEPS, loss_of=None):
    """Each rank its own mean loss; returns the mean over dp ranks of each step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = loss_of(model) if loss_of else F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, group=dp_group)
        losses.append(avg / dist.get_world_size(dp_group))
    return losses, opt


def _local_bytes(model, opt) -> int:
    """Parameters + gradients + optimizer state held by this rank."""
    def nbytes(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    total = sum(nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
    for state in opt.state.values():
        total += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _setup(steps=STEPS):
    """The 2 x 2 mesh, the global batch, this rank's dp rows, the model, and one device's
    copy of it trained ``steps`` steps on the global batch (with its losses)."""
    mesh = make_mesh({"dp": 2, "tp": 2})
    dp = mesh.get_local_rank("dp")
    ids, targets = _data()
    mine = slice(dp * B // 2, (dp + 1) * B // 2)
    model = llama(seed=0)
    reference = copy.deepcopy(model)
    return mesh, ids, targets, mine, model, reference, _one_device(reference, ids, targets, steps=steps)


def _fsdp2_by_hand(model, mesh, blocks):
    """torchtitan's composition after TP: FSDP2 on every block, then on the root."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for block in blocks:
        torch_fully_shard(block, mesh=mesh["dp"])
    torch_fully_shard(model, mesh=mesh["dp"])
    return model


def _check_llama(rank: int, world_size: int) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    from fxshard.testing.bench_contenders import localize_llama_heads, torch_llama_plan

    mesh, ids, targets, mine, model, reference, want = _setup()

    # fxshard TP + FSDP2
    plan = Plan(mesh, llama_plan("tp", sequence_parallel=True), inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.transform(model, plan, example_inputs=(ids.clone(),))  # runs on ids[mine]: other tensors
    assert [n for n in program_meta(sharded).fsdp_units] == ["layers.0", "layers.1"]
    assert isinstance(sharded.layers[0], torch.fx.GraphModule) and "self.layers" in sharded.code
    with pytest.raises(PlanError, match="fully_shard"):
        sharded(ids[mine])
    fxshard.fully_shard(sharded, mesh)
    got, opt = _train_local(sharded, ids[mine], targets[mine], mesh.get_group("dp"))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-5)
    full = fxshard.full_state_dict(sharded)
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(full[name], p, rtol=1e-4, atol=1e-5, msg=lambda m: f"fxshard {name}: {m}")

    # a full checkpoint loads back: each rank keeps its FSDP2 shard of its TP shard
    fresh = llama(seed=3).state_dict()
    fxshard.load_full_state_dict(sharded, fresh)
    again = fxshard.full_state_dict(sharded)
    for name, p in fresh.items():
        torch.testing.assert_close(again[name], p, rtol=0, atol=0, msg=lambda m: f"reloaded {name}: {m}")
    fxshard.load_full_state_dict(sharded, full)

    # torchtitan-style: DTensor TP, then FSDP2 per block and root, on the same model
    titan = localize_llama_heads(parallelize_module(llama(seed=0), mesh["tp"], torch_llama_plan(sequence_parallel=True)), 2)
    _fsdp2_by_hand(titan, mesh, titan.layers)
    theirs, titan_opt = _train_local(titan, ids[mine], targets[mine], mesh.get_group("dp"))
    torch.testing.assert_close(torch.stack(got), torch.stack(theirs), rtol=1e-4, atol=1e-5)
    for name, p in titan.state_dict().items():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full[name], t, rtol=1e-4, atol=1e-5, msg=lambda m: f"vs DTensor+FSDP2 {name}: {m}")

    # memory: parameters, gradients, AdamW state per rank vs one device
    ref_opt = torch.optim.AdamW(reference.parameters())
    for p in reference.parameters():
        ref_opt.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    ratio = _local_bytes(sharded, opt) / _local_bytes(reference, ref_opt)
    # every weight is sharded over tp and dp; only the norm weights are replicated over tp
    replicated = sum(p.numel() for n, p in reference.named_parameters() if "norm" in n)
    total = sum(p.numel() for p in reference.parameters())
    expect = ((total - replicated) / 4 + replicated / 2) / total
    assert abs(ratio - expect) < 1e-3 and ratio < 0.26, (ratio, expect)
    assert abs(ratio - _local_bytes(titan, titan_opt) / _local_bytes(reference, ref_opt)) < 0.01


def test_llama_tp_fsdp2_equals_one_device_and_dtensor_fsdp2():
    spawn(_check_llama, 4)


def _check_hf_llama(rank: int, world_size: int) -> None:
    import transformers

    mesh = make_mesh({"dp": 2, "tp": 2})
    dp = mesh.get_local_rank("dp")
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    ids, labels = _data()
    labels[:, :2] = -100  # the prompt masked: as many scored tokens in every row (so on every dp rank)
    mine = slice(dp * B // 2, (dp + 1) * B // 2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    want = []
    for _ in range(STEPS):
        loss = reference(input_ids=ids, labels=labels).loss
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        want.append(loss.detach())

    batch = {"input_ids": {"dp": Shard(0)}, "labels": {"dp": Shard(0)}}
    plan = Plan.from_hf(mesh, model).replace(inputs=batch, fsdp="dp")
    def trains_as_one_device(sharded, what: str) -> tuple[list, dict]:
        fxshard.fully_shard(sharded, mesh)
        got, _ = _train_local(sharded, None, None, mesh.get_group("dp"),
                              loss_of=lambda m: m(input_ids=ids[mine], labels=labels[mine]).loss)
        # each rank's mean over its tokens (HF's in-graph loss); equal counts per rank, so the mean of
        # the means is the global mean
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-5)
        full = fxshard.full_state_dict(sharded)
        for name, p in reference.state_dict().items():
            torch.testing.assert_close(full[name], p, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} {name}: {m}")
        return got, full

    example = ids.clone()  # one tensor under both names, as the README writes it; the run passes distinct ones
    sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": example, "labels": example})
    assert program_meta(sharded).fsdp_units == ["model.layers.0", "model.layers.1"]
    got, full = trains_as_one_device(sharded, "HF")

    # the same with HF's gradient checkpointing on: each decoder layer checkpointed inside FSDP2's hooks
    checkpointing = copy.deepcopy(model)
    checkpointing.gradient_checkpointing_enable()
    sharded = fxshard.transform(checkpointing, plan, example_kwargs={"input_ids": ids, "labels": labels})
    assert fxshard.checkpointed_blocks(sharded) == ["model.layers.0", "model.layers.1"]
    trains_as_one_device(sharded, "HF checkpointed")

    # DTensor TP with the plan equal to HF's, then FSDP2, on the same model
    from torch.distributed.tensor.parallel import parallelize_module

    from fxshard.testing.bench_contenders import torch_hf_llama_plan

    titan = parallelize_module(copy.deepcopy(model), mesh["tp"], torch_hf_llama_plan())
    _fsdp2_by_hand(titan, mesh, titan.model.layers)
    theirs, _ = _train_local(titan, None, None, mesh.get_group("dp"),
                             loss_of=lambda m: m(input_ids=ids[mine], labels=labels[mine]).loss)
    torch.testing.assert_close(torch.stack(got), torch.stack(theirs), rtol=1e-4, atol=1e-5)
    for name, p in titan.state_dict().items():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full[name], t, rtol=1e-4, atol=1e-5, msg=lambda m: f"HF vs DTensor+FSDP2 {name}: {m}")


def test_hf_llama_tp_fsdp2_equals_one_device():
    spawn(_check_hf_llama, 4)


def _check_mixed_precision(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh, ids, targets, mine, model, reference, want = _setup(steps=1)
    plan = Plan(mesh, llama_plan("tp", sequence_parallel=True), inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.transform(model, plan, example_inputs=(ids.clone(),))
    fxshard.fully_shard(sharded, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    got, _ = _train_local(sharded, ids[mine], targets[mine], mesh.get_group("dp"), steps=1)
    torch.testing.assert_close(got[0].float(), want[0], rtol=2e-2, atol=2e-2)  # bf16 compute
    assert all(p.dtype == torch.float32 for p in sharded.parameters())  # sharded parameters stay fp32
    full = fxshard.full_state_dict(sharded)
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(full[name], p, rtol=0, atol=2e-2, msg=lambda m: f"bf16 {name}: {m}")


    # torch.compile consumes the FSDP2-wrapped module: the same numbers as eager
    from torch._dynamo.testing import CompileCounterWithBackend

    plain = fxshard.transform(model, Plan(mesh, llama_plan("tp", sequence_parallel=True), inputs={"tokens": {"dp": Shard(0)}},
                                          fsdp="dp"), example_inputs=(ids.clone(),))
    fxshard.fully_shard(plain, mesh)
    eager = plain(ids[mine])
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(plain, backend=counter)(ids[mine])
    torch.testing.assert_close(compiled, eager)
    F.cross_entropy(compiled.flatten(0, 1), targets[mine].flatten()).backward()
    assert counter.frame_count >= 1


def test_mixed_precision_bf16_params_fp32_reduce_and_compile():
    spawn(_check_mixed_precision, 4)


# --------------------------------------------------------------------------- offline: the graph


def _offline(**kw):
    ids, _ = _data()
    plan = Plan(MeshSpec(("dp", "tp"), (2, 2)), llama_plan("tp", sequence_parallel=True), inputs={"tokens": {"dp": Shard(0)}}, **kw)
    return fxshard.transform(llama(seed=0), plan, example_inputs=(ids,))


def test_fsdp_axis_gets_no_grad_sync_and_buckets_stay_in_blocks():
    sharded = _offline(fsdp="dp")
    summary = fxshard.comm_summary(sharded)
    assert summary.count(axis="dp") == 0
    rows = [r for r in summary.rows if r.op == "grad_sync_bucket"]
    assert [(r.region, r.axis, r.shape) for r in rows] == [("norm", "tp", (64,)), ("layers.1", "tp", (128,)), ("layers.0", "tp", (128,))]
    code = sharded.layers[0].code
    assert "fxshard_grad_sync_bucket([layers_0_ffn_norm_weight, layers_0_attention_norm_weight], 'tp')" in code
    assert "self.layers[0]" not in code and 'getattr(self.layers, "0")(' in sharded.code
    # without fsdp=: fxshard sums over dp itself, one bucket per axis for the whole model
    plain = fxshard.comm_summary(_offline())
    assert plain.count("backward", "all_reduce", axis="dp") == 1 and plain.count("backward", "all_reduce", axis="tp") == 1


def test_state_dict_keys_are_the_models():
    sharded = _offline(fsdp="dp")
    assert set(sharded.state_dict()) == set(llama(seed=0).state_dict())


def test_fully_shard_refuses_a_plan_without_fsdp_axis():
    with pytest.raises(PlanError, match="fsdp='dp'"):
        fxshard.fully_shard(_offline())


def test_plan_fsdp_axis_must_be_on_the_mesh():
    with pytest.raises(PlanError, match="not an axis of the mesh"):
        Plan(MeshSpec(("dp", "tp"), (2, 2)), {}, fsdp="data")


def test_mean_loss_over_batch_shards_is_allowed_only_on_the_fsdp_axis():
    from fxshard.testing.models import WithLoss

    ids, targets = _data()
    mesh = MeshSpec(("dp", "tp"), (2, 2))
    specs = {f"model.{k}": v for k, v in llama_plan("tp").items()}
    inputs = {"tokens": {"dp": Shard(0)}, "targets": {"dp": Shard(0)}}
    with pytest.raises(PlanError, match="fsdp='dp'"):
        fxshard.transform(WithLoss(llama(seed=0)), Plan(mesh, specs, inputs=inputs), (ids, targets))
    sharded = fxshard.transform(WithLoss(llama(seed=0)), Plan(mesh, specs, inputs=inputs, fsdp="dp"), (ids, targets))
    loss = next(n for n in sharded.graph.nodes if n.op == "output").args[0]
    from torch.distributed.tensor import Partial, Replicate

    from fxshard.meta import info
    assert info(loss).value.layout == {"dp": Partial("avg"), "tp": Replicate()}


def test_fsdp_axis_may_only_shard_the_batch():
    ids, _ = _data()
    mesh = MeshSpec(("dp", "tp"), (2, 2))
    with pytest.raises(PlanError, match=r"parameter 'layers.0.attention.wq.weight' is laid out S\(0\) on 'tp'"):
        fxshard.transform(llama(seed=0), Plan(mesh, llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}}, fsdp="tp"), (ids,))
    gathered = {**llama_plan("tp"), "output": fxshard.ModuleSpec(out_dst={"dp": Replicate()})}
    with pytest.raises(PlanError, match="communicate on 'dp'"):
        fxshard.transform(llama(seed=0), Plan(mesh, gathered, inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp"), (ids,))
