"""Pipeline parallelism composed with the other parallelisms, on more models, and the training
loop's features across stages, on real gloo ranks against one device (docs/pipeline.md).

4 ranks, one spawn: HF Mixtral at pp=2 x ep=2 with the experts sharded over ep by
HF's own plan; HF Llama at pp=2 x cp=2, attention context-parallel, the hidden states gathered before
the head so that the model's loss is the global token mean; HF Qwen3 at pp=2 x tp=2 with its own plan;
torchtitan's Llama3 (no loss of its own) at pp=2 x tp=2 with ``loss_fn=``.  Every case: 2 AdamW steps
through ``fxshard.train_step``, loss, clipped global gradient norm and every full parameter after the
steps equal to one device's on the same global batch (``check_case`` of test_train_step.py).

2 ranks, one spawn, on a mesh of the pipeline axis alone (``init_device_mesh("cpu", (2,), ("pp",))``):
HF Llama under the V schedule ZBVZeroBubble (virtual=2, rank r holding stages r and 3 - r), as above;
HF GPT-2 (embedding tied to the head across the stages) loaded from a one-device checkpoint with its
optimizer state, a step of gradient accumulation (``fxshard.no_sync`` around all micro-steps but the
last), saved at pp=2 and loaded into the zeroed pp=2 model (a new optimizer) and into one device, a
step more on each: all equal to one device.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.pipelining import pipeline, pipeline_transform, train_step
from fxshard.testing.hf_tiny import tiny_inputs
from fxshard.meta import program_meta

try:
    from harness import make_mesh, spawn
    from pipeline.test_train_step import ATOL, EPS, LR, MAX_NORM, check_case, four_block_model
except ImportError:  # tests/ imported as a package
    from tests.harness import make_mesh, spawn
    from tests.pipeline.test_train_step import ATOL, EPS, LR, MAX_NORM, check_case, four_block_model

pytest.importorskip("transformers")


def hf_cp_plan(mesh):
    """Attention over a sequence sharded on ``cp`` (contiguous pieces); the final norm's output
    gathered over ``cp``, so that the last stage's logits are the whole sequence's and HF's loss
    (which shifts the labels along the sequence) runs on them with the labels replicated."""
    gather = fxshard.ModuleSpec(out_src={"cp": Shard(1)}, out_dst={"cp": Replicate()})
    return fxshard.Plan(mesh["cp"], {"model.layers.*.self_attn": fxshard.context_parallel("cp", load_balance=False),
                                     "model.norm": gather},
                        inputs={"input_ids": {"cp": Shard(1)}})


def experts_halved(staged, name: str) -> None:
    """Each ep rank holds 2 of the 4 experts of each of its MoE blocks."""
    experts = [p for fqn, p in staged.named_parameters() if fqn.endswith("experts.gate_up_proj")]
    assert experts and all(p.shape[0] == 2 for p in experts), f"{name}: {[tuple(p.shape) for p in experts]}"


def attention_context_parallel(staged, name: str) -> None:
    """Every stage's attention runs over the sequence sharded on cp (KV gathered over cp)."""
    for st in staged.stages:
        assert "fxshard_all_gather" in st.code and "'cp'" in st.code, f"{name}: no cp collective in\n{st.code}"


def logits_cross_entropy(output, target: torch.Tensor) -> torch.Tensor:
    """Of an HF output's logits (the last stage returns the model's output structure's tensors)."""
    return token_cross_entropy(getattr(output, "logits", output), target)


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _check_torchtitan_llama3(mesh_shape: dict) -> str:
    """torchtitan's Llama3 (tokens -> logits, no loss) with torchtitan's own TP/SP plan, trained
    with ``loss_fn=`` and ``target=``: 2 AdamW steps with clipping equal to one device."""
    from fxshard.testing.torchtitan_models import tiny_llama3

    mesh = make_mesh(mesh_shape)
    model = tiny_llama3(n_layers=4)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    ids, target = torch.randint(0, 128, (4, 8), generator=g), torch.randint(0, 128, (4, 8), generator=g)
    spec = pipeline("pp", microbatches=2, schedule="1F1B")
    plan = fxshard.Plan.from_torchtitan(mesh["tp"], model).replace(pipeline=spec)
    staged = pipeline_transform(model, plan, mesh, example_inputs=(torch.randint(0, 128, (2, 6), generator=g),))
    name = f"torchtitan llama3 {mesh_shape} stage(s) {staged.stage_ids}"
    opt = torch.optim.AdamW(staged.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS)
    for step in range(2):
        loss = train_step(staged, {"tokens": ids}, loss_fn=token_cross_entropy, target=target)
        ref_loss = token_cross_entropy(reference(ids), target)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=ATOL, msg=lambda m: f"{name} step {step}: {m}")
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        norm = fxshard.clip_grad_norm_(staged, MAX_NORM)
        torch.testing.assert_close(norm, ref_norm, atol=ATOL, rtol=ATOL, msg=lambda m: f"{name} step {step} norm: {m}")
        assert ref_norm > MAX_NORM, f"{name}: clipping at {MAX_NORM} does nothing to a norm of {float(ref_norm)}"
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_state = dict(reference.named_parameters())  # its state_dict splits the fused wqkv; the parameters do not
    full = fxshard.full_state_dict(staged)  # this rank's stage, gathered over tp
    assert full and len(full) < len(ref_state), name
    for fqn, t in full.items():
        torch.testing.assert_close(t, ref_state[fqn], atol=ATOL, rtol=ATOL, msg=lambda m: f"{name} {fqn}: {m}")
    return name


def loss_fn_over_gathered_cp(staged, name: str) -> None:
    """Before the case's steps: ``loss_fn=`` on the logits gathered over cp gives one device's loss and
    gradients.  Every cp rank scores the whole sequence, and fxshard sums the parameters' gradients
    over the ranks' slices, so the loss counts once (it is not averaged over cp)."""
    reference = four_block_model("llama")  # the case's model, seeded
    ids, _ = tiny_inputs(batch=4, seq=8, seed=1)
    target = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(3))
    assert staged.batch_axes == (), f"{name}: {staged.batch_axes}"
    cp = program_meta(staged).mesh["cp"]
    mine = ids.chunk(cp, 1)[torch.distributed.get_rank() % cp]  # the mesh is (pp, cp): cp is the inner dim
    loss = train_step(staged, {"input_ids": mine}, loss_fn=logits_cross_entropy, target=target)
    ref_loss = logits_cross_entropy(reference(input_ids=ids), target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=ATOL, msg=lambda m: f"{name} loss_fn: {m}")
    want = dict(reference.named_parameters())
    for fqn, p in staged.named_parameters():
        torch.testing.assert_close(p.grad, want[fqn].grad, atol=ATOL, rtol=ATOL, msg=lambda m: f"{name} loss_fn: {fqn}: {m}")
        p.grad = None


def cp_checks(staged, name: str) -> None:
    attention_context_parallel(staged, name)
    loss_fn_over_gathered_cp(staged, name)


def _four_ranks(rank: int, world_size: int) -> None:
    check_case("mixtral", {"pp": 2, "ep": 2}, "1F1B", 2, 1, "ep", post=experts_halved)
    check_case("llama", {"pp": 2, "cp": 2}, "1F1B", 2, 1, False, plan_fn=hf_cp_plan, post=cp_checks)
    check_case("qwen3", {"pp": 2, "tp": 2}, "1F1B", 2, 1, True)
    _check_torchtitan_llama3({"pp": 2, "tp": 2})


@pytest.mark.sweep  # ~100 s of 4 real ranks on 2 cores: .ci/run's second stage (the main stage's 30 minutes)
def test_pp2_composed_with_ep_cp_tp_on_mixtral_llama_qwen3_torchtitan_equal_one_device():
    spawn(_four_ranks, 4)


# ----------------------------------------------------------------------------- 2 ranks, pp alone

ACCUMULATE = 3  # micro-steps of the accumulated step


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of step ``step`` (1, 2, 3): one, or ``ACCUMULATE`` for step 2 (accumulated)."""
    return [tiny_inputs(batch=4, seq=8, seed=10 * step + i) for i in range(ACCUMULATE if step == 2 else 1)]


def _reference(steps: int):
    """One device's GPT-2 and AdamW after ``steps`` steps (step 2 accumulates its micro-steps),
    gradients clipped; and the loss of each step's micro-steps."""
    model = four_block_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(1, steps + 1):
        losses.append([])
        for ids, labels in _batches(step):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            losses[-1].append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return model, opt, losses


def _fresh_staged(mesh):
    """GPT-2 at pp=2 (1F1B, 2 micro-batches), every parameter zeroed: after a load it holds the checkpoint's."""
    ids, labels = tiny_inputs(batch=2, seq=6, seed=2)
    staged = pipeline_transform(four_block_model("gpt2"), None, mesh, example_kwargs={"input_ids": ids, "labels": labels},
                                spec=pipeline("pp", microbatches=2))
    with torch.no_grad():
        for p in staged.parameters():
            p.zero_()
    return staged, torch.optim.AdamW(staged.parameters(), lr=LR, eps=EPS)


def _check_params(staged, reference, name: str) -> None:
    want = dict(reference.named_parameters(remove_duplicate=False))
    held = dict(staged.named_parameters(remove_duplicate=False))
    assert held and len(held) < len(want), name
    for fqn, p in held.items():
        torch.testing.assert_close(p, want[fqn], atol=ATOL, rtol=ATOL, msg=lambda m: f"{name}: {fqn}: {m}")


def _accumulate_save_load(mesh, one_device_ckpt: str, pp_ckpt: str) -> None:
    """Step 1 on one device (the checkpoint), step 2 accumulated at pp=2 under no_sync and saved,
    step 3 at pp=2 after loading that checkpoint into the zeroed stages and a new optimizer."""
    staged, opt = _fresh_staged(mesh)
    fxshard.load(staged, one_device_ckpt, optimizer=opt)  # one device -> pp=2, with AdamW's moments and step
    reference, _, _ = _reference(1)
    _check_params(staged, reference, "one-device checkpoint loaded at pp=2")
    reference, _, ref_losses = _reference(2)
    batches = _batches(2)
    tied = staged.get_parameter("transformer.wte.weight")
    for i, (ids, labels) in enumerate(batches):
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else fxshard.no_sync(staged):
            loss = train_step(staged, {"input_ids": ids, "labels": labels})
        torch.testing.assert_close(loss, ref_losses[1][i], atol=ATOL, rtol=ATOL, msg=lambda m: f"micro-step {i}: {m}")
        if i == 0:  # held back: this rank's copy of the tied weight has its own stage's part of the gradient only
            part = tied.grad.clone()
    staged_grads = {fqn: p.grad for fqn, p in staged.named_parameters(remove_duplicate=False)}
    # the gradients of one device summed over the micro-steps: step 2's, before clipping
    ref_model = _reference(1)[0]
    for i, (ids, labels) in enumerate(batches):
        ref_model(input_ids=ids, labels=labels).loss.backward()
        if i == 0:
            first = ref_model.get_parameter("transformer.wte.weight").grad.clone()
    ref_grads = dict(ref_model.named_parameters(remove_duplicate=False))
    for fqn, g in staged_grads.items():
        torch.testing.assert_close(g, ref_grads[fqn].grad, atol=ATOL, rtol=ATOL, msg=lambda m: f"accumulated {fqn}: {m}")
    # inside no_sync the embedding's and the head's parts were not summed: the two ranks' parts add up to it
    assert not torch.allclose(part, first, atol=1e-4), "the tied weight was summed inside no_sync"
    both = part.clone()
    torch.distributed.all_reduce(both)
    torch.testing.assert_close(both, first, atol=ATOL, rtol=ATOL, msg=lambda m: f"the tied weight's parts: {m}")
    fxshard.clip_grad_norm_(staged, MAX_NORM)
    opt.step()
    opt.zero_grad()
    _check_params(staged, reference, "after the accumulated step")
    fxshard.save(staged, pp_ckpt, optimizer=opt)

    # pp=2 -> pp=2: every parameter zeroed and a new optimizer (a fresh model's state), the checkpoint loaded,
    # one step more (the same stages: another transform would cost the suite seconds and test nothing more)
    with torch.no_grad():
        for p in staged.parameters():
            p.zero_()
    opt = torch.optim.AdamW(staged.parameters(), lr=LR, eps=EPS)
    fxshard.load(staged, pp_ckpt, optimizer=opt)
    reference, _, ref_losses = _reference(3)
    (ids, labels), = _batches(3)
    loss = train_step(staged, {"input_ids": ids, "labels": labels})
    torch.testing.assert_close(loss, ref_losses[2][0], atol=ATOL, rtol=ATOL, msg=lambda m: f"step 3 after load: {m}")
    fxshard.clip_grad_norm_(staged, MAX_NORM)
    opt.step()
    _check_params(staged, reference, "pp=2 checkpoint loaded at pp=2, a step later")


def _two_ranks(rank: int, world_size: int, one_device_ckpt: str, pp_ckpt: str) -> None:
    # DualPipeV (M=4) passes the same check; left out of the suite for its time
    check_case("llama", {"pp": 2}, "ZBVZeroBubble", 2, 2, False)
    _accumulate_save_load(make_mesh({"pp": 2}), one_device_ckpt, pp_ckpt)


def test_pp_mesh_alone_v_schedules_no_sync_and_checkpoints_across_pp2_and_one_device_equal_one_device(tmp_path):
    one_device, pp = str(tmp_path / "one_device"), str(tmp_path / "pp2")
    model, opt, _ = _reference(1)
    fxshard.save(model, one_device, optimizer=opt)  # a plain model: no process group
    spawn(_two_ranks, 2, one_device, pp)
    # pp=2 -> one device: the checkpoint of the accumulated step, with AdamW's state, one step more
    model = four_block_model("gpt2")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    fxshard.load(model, pp, optimizer=opt)
    reference, _, ref_losses = _reference(3)
    (ids, labels), = _batches(3)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_losses[2][0], atol=ATOL, rtol=ATOL)
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    want = reference.state_dict()
    for fqn, t in model.state_dict().items():
        torch.testing.assert_close(t, want[fqn], atol=ATOL, rtol=ATOL, msg=lambda m: f"pp=2 checkpoint on one device: {fqn}: {m}")
