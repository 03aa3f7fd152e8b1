"""Pipeline parallelism on real gloo ranks against one device (docs/pipeline.md).

Every case: an HF model (4 blocks, random weights, seeded), transformed with other example
tensors than it runs with, cut into stages, 2 AdamW steps through ``train_step`` on a batch
whose labels carry -100 padding.  The loss of each step, the gradients of the first step and
every full parameter after the steps (gradients clipped to a global norm) must equal one
device's on the same global batch; each
rank must hold only its stage's parameters.  Cases are batched into one spawn per world size.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import fxshard
from fxshard.pipelining import pipeline, pipeline_transform, train_step
from fxshard.testing.hf_tiny import ALIASES, TinyBuildError, config_class, tiny_inputs, tiny_kwargs, tiny_model
from fxshard.testing.models import llama, tokens
from fxshard.meta import program_meta

try:
    from harness import make_mesh, spawn
except ImportError:  # tests/ imported as a package
    from tests.harness import make_mesh, spawn

ATOL = 1e-5
LR = 1e-3  # AdamW moves every element by about LR: a gradient of the wrong sign shows
MAX_NORM = 0.5
EPS = 1e-6  # AdamW's step is g / (|g| + eps): with torch's 1e-8 a gradient of 1e-9 summed in another order moves by ~LR


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2's DTensor gradient


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _four_layers(cls, kwargs: dict) -> dict:
    """Overrides of a tiny config's ``kwargs`` (config class ``cls``) that make it 4 layers: the layer
    count under the family's name for it, every per-layer list repeated, every list of layer indices
    renumbered; a composite config's ``text_config`` (Llama 4) made so in turn."""
    default = cls()

    def default_of(name):  # a heterogeneous config (Dots3) refuses a global read of a per-layer attribute
        try:
            return getattr(default, name, None)
        except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError
            return vars(default).get(name)
    count = next((f for f in ("num_hidden_layers", *ALIASES["num_hidden_layers"]) if f in kwargs), None)
    if count is None:
        sub = (getattr(cls, "sub_configs", None) or {}).get("text_config")
        if any(isinstance(v, list) and len(v) == 4 for v in kwargs.values()):
            return {}  # the layer count is a per-layer list's length, 4 already (Nemotron-H's layers_block_type)
        if sub is None or not isinstance(kwargs.get("text_config"), dict):
            raise TinyBuildError(f"{cls.__name__}: no layer count among its fields")
        return {"text_config": {**kwargs["text_config"], **_four_layers(sub, kwargs["text_config"])}}
    n, n_default = kwargs[count], default_of(count)
    more = {count: 4}
    for field, value in kwargs.items():
        was = default_of(field)
        if not isinstance(value, list) or not isinstance(was, (list, type(None))):
            continue
        ints = all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        # layer indices (Llama 4's moe_layers): sorted distinct indices, and so by default (no_rope_layers is not)
        indices = ints and value == sorted(set(value)) and all(0 <= i < n for i in value) and \
            (was is None or was == sorted(set(was)))
        if len(value) == n and not indices:  # one entry per layer
            more[field] = [value[i % n] for i in range(4)]
        elif indices:
            more[field] = [i for i in range(4) if i % n in set(value)]
    return more


def four_block_model(family: str):
    """The tiny HF model with 4 blocks: every per-layer list of the tiny config (``layer_types``,
    ``mlp_layer_types`` ...: HF checks their length) repeated to 4, every list of layer indices
    (``moe_layers``) renumbered to the layers that repeat them."""
    cls = config_class(family)
    return tiny_model(family, **_four_layers(cls, tiny_kwargs(cls, family)))


def check_case(family: str, mesh_shape: dict, schedule: str, microbatches: int, virtual: int, tp_plan: bool | str,
                on_meta: bool = False, save_to: str | None = None, fsdp: bool = False, plan_fn=None,
                post=None) -> str:
    """``tp_plan``: the model's HF plan (``Plan.from_hf``) on mesh axis ``"tp"`` (``True``) or the one
    named (``"ep"``).  ``plan_fn(mesh)``: the plan otherwise (the batch's inputs chunked on dim 1
    over ``cp``, on dim 0 over ``dp``).  ``post(staged, name)``: more checks of the staged module.  ``on_meta``: the model is built on the meta device, transformed and cut, only this rank's
    stage materialized and loaded from the reference's full state dict.  ``save_to``: a
    checkpoint of the trained stages (and optimizer) is saved there."""
    mesh = make_mesh(mesh_shape)
    model = four_block_model(family)
    ids, labels = tiny_inputs(batch=4, seq=8, seed=1)
    example_ids, example_labels = tiny_inputs(batch=2, seq=6, seed=2)  # other tensors, other sizes
    assert (labels == -100).any() and not torch.equal(ids, labels)
    reference = copy.deepcopy(model)
    spec = pipeline("pp", microbatches=microbatches, schedule=schedule, virtual=virtual)
    source = model
    if on_meta:
        with torch.device("meta"):
            source = four_block_model(family)
    if plan_fn is not None:
        plan = plan_fn(mesh).replace(pipeline=spec)
    elif tp_plan:
        plan = fxshard.Plan.from_hf(mesh["tp" if tp_plan is True else tp_plan], source).replace(pipeline=spec)
    elif "dp" in mesh_shape:  # the batch sharded: every rank passes its rows, the loss is the whole batch's mean
        plan = fxshard.Plan(mesh["dp"], {}, inputs={"input_ids": {"dp": Shard(0)}, "labels": {"dp": Shard(0)}},
                            fsdp="dp" if fsdp else None, pipeline=spec)
    else:
        plan = None
    dp, cp = mesh_shape.get("dp", 1), mesh_shape.get("cp", 1)
    rows = (lambda t: t.chunk(dp)[mesh["dp"].get_local_rank()]) if dp > 1 else (lambda t: t)

    def mine(t):  # this rank's share: its rows, and of the input ids its piece of the sequence
        return rows(t).chunk(cp, 1)[mesh["cp"].get_local_rank()] if cp > 1 and t is ids else rows(t)
    staged = pipeline_transform(source, plan, mesh, example_kwargs={"input_ids": example_ids, "labels": example_labels},
                                spec=spec if plan is None else None)
    name = f"{family} {mesh_shape} {schedule} M={microbatches} v={virtual}{' fsdp' if fsdp else ''} stage(s) {staged.stage_ids}"
    if fsdp:
        fxshard.fully_shard(staged, mesh["dp"])  # FSDP2 on each of this rank's stages
    if on_meta:
        assert all(p.is_meta for p in staged.parameters()), name
        fxshard.materialize(staged, source, device="cpu", init=None)
        fxshard.load_full_state_dict(staged, model.state_dict(), strict=False)  # the other stages' keys are not this rank's
        assert not any(p.is_meta for p in staged.parameters()), name
    # this rank holds its stages' blocks and no other
    held_blocks = {b for st in staged.stages for b in program_meta(st).pipeline_stage.blocks}
    for fqn, _ in staged.named_parameters(remove_duplicate=False):
        for i in range(4):
            block = f".{i}."
            if block in f".{fqn}" and not any(fqn.startswith(b + ".") for b in held_blocks):
                raise AssertionError(f"{name}: holds {fqn} of another stage")
    assert held_blocks and len(held_blocks) < 4, name
    if post is not None:
        post(staged, name)

    opt = torch.optim.AdamW(staged.parameters(), lr=LR, eps=EPS)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS)
    tp_sharded = mesh_shape.get("tp", 1) > 1 or mesh_shape.get("ep", 1) > 1  # gradients are local shards
    for step in range(2):
        loss = train_step(staged, {"input_ids": mine(ids), "labels": mine(labels)})
        ref_loss = reference(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=ATOL, msg=lambda m: f"{name} step {step} loss: {m}")
        # the norm over all stages (a tied weight once), and clipping that takes effect
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        norm = fxshard.clip_grad_norm_(staged, MAX_NORM)  # the norm over every stage
        torch.testing.assert_close(norm, ref_norm, atol=ATOL, rtol=ATOL, msg=lambda m: f"{name} step {step} grad norm: {m}")
        assert ref_norm > MAX_NORM, f"{name}: clipping at {MAX_NORM} does nothing to a norm of {float(ref_norm)}"
        if step == 0 and not tp_sharded:
            ref_params = dict(reference.named_parameters(remove_duplicate=False))
            for fqn, p in staged.named_parameters(remove_duplicate=False):
                want = ref_params[fqn].grad
                torch.testing.assert_close(_full(p.grad) if p.grad is not None else torch.zeros_like(p),
                                           want if want is not None else torch.zeros_like(p), atol=ATOL, rtol=ATOL,
                                           msg=lambda m: f"{name} grad of {fqn}: {m}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    if save_to is not None:
        fxshard.save(staged, save_to, optimizer=opt)
    full = fxshard.full_state_dict(staged)
    ref_state = reference.state_dict()
    assert full, name
    for fqn, t in full.items():
        torch.testing.assert_close(t, ref_state[fqn], atol=ATOL, rtol=ATOL, msg=lambda m: f"{name} {fqn} after 2 steps: {m}")
    # another batch and sequence length: the schedule is made again for the new shapes
    ids, labels = tiny_inputs(batch=2 * microbatches * dp, seq=6, seed=3)
    loss = train_step(staged, {"input_ids": mine(ids), "labels": mine(labels)})
    ref_loss = reference(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=ATOL, msg=lambda m: f"{name} other shapes loss: {m}")
    if not tp_sharded:  # gradient accumulation: a second step adds its gradient (a tied weight's once)
        ref_loss.backward()
        train_step(staged, {"input_ids": mine(ids), "labels": mine(labels)})
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        for fqn, p in staged.named_parameters(remove_duplicate=False):
            want = ref_params[fqn].grad  # None: unused at these shapes (a MoE's expert no token chose)
            # the sum of two gradients, each within ATOL of the reference's: within 2 ATOL of twice it
            torch.testing.assert_close(_full(p.grad) if p.grad is not None else torch.zeros_like(p),
                                       2 * want if want is not None else torch.zeros_like(p), atol=2 * ATOL, rtol=ATOL,
                                       msg=lambda m: f"{name} accumulated grad of {fqn}: {m}")
    return name


def _check_user_loss(mesh_shape: dict) -> None:
    """A model without a loss of its own (fxshard's Llama: tokens -> logits) and ``loss_fn=``: the
    micro-batch means are averaged (and over the data-parallel ranks), which is the batch's mean
    when every micro-batch scores as many tokens (no -100 here), and the gradients are one device's."""
    mesh = make_mesh(mesh_shape)
    model = llama(n_layers=4)
    reference = copy.deepcopy(model)
    ids, target = tokens(4, 8, 128, seed=1), tokens(4, 8, 128, seed=2)
    spec = pipeline("pp", microbatches=2, schedule="1F1B")
    dp = mesh_shape.get("dp", 1)
    plan = fxshard.Plan(mesh["dp"], {}, inputs={"tokens": {"dp": Shard(0)}}, pipeline=spec) if dp > 1 else None
    staged = fxshard.pipeline_transform(model, plan, mesh, example_inputs=(tokens(2, 6, 128, seed=3),),
                                        spec=spec if plan is None else None)
    assert staged.loss_program is None
    mine = (lambda t: t.chunk(dp)[mesh["dp"].get_local_rank()]) if dp > 1 else (lambda t: t)
    loss = train_step(staged, {"tokens": mine(ids)}, loss_fn=cross_entropy, target=mine(target))
    ref_loss = cross_entropy(reference(ids), target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=ATOL)
    ref_params = dict(reference.named_parameters())
    for fqn, p in staged.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[fqn].grad, atol=ATOL, rtol=ATOL, msg=lambda m: f"user loss: {fqn}: {m}")


def _two_ranks(rank: int, world_size: int) -> None:
    pp = {"pp": 2, "tp": 1}
    for case in [("llama", pp, "1F1B", 2, 1, False), ("llama", pp, "Interleaved1F1B", 2, 2, False),
                 ("gpt2", pp, "1F1B", 4, 1, False)]:
        check_case(*case)
    _check_user_loss({"pp": 2, "tp": 1})


def _four_ranks(rank: int, world_size: int, checkpoint: str) -> None:
    check_case("llama", {"pp": 2, "tp": 2}, "1F1B", 2, 1, True, on_meta=True, save_to=checkpoint)
    # the rows of one dp rank score other numbers of tokens than the other's (-100 at random)
    check_case("llama", {"pp": 2, "dp": 2}, "GPipe", 2, 1, False, fsdp=True)  # GPipe here, 1F1B on 2 ranks
    _check_user_loss({"pp": 2, "dp": 2})


def _reference_after_two_steps(family: str):
    model = tiny_model(family, num_hidden_layers=4)
    ids, labels = tiny_inputs(batch=4, seq=8, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for _ in range(2):
        model(input_ids=ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return model


def test_pp2_llama_schedules_and_gpt2_tied_head_equal_one_device():
    spawn(_two_ranks, 2)


def test_pp2_x_tp2_from_meta_and_pp2_x_dp2_llama_equal_one_device_and_a_checkpoint_loads_on_one_device(tmp_path):
    spawn(_four_ranks, 4, str(tmp_path / "ckpt"))
    # resharding pp=2 x tp=2 -> one device: every parameter is in the checkpoint, as trained
    model = tiny_model("llama", num_hidden_layers=4)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fxshard.load(model, str(tmp_path / "ckpt"))
    want = _reference_after_two_steps("llama").state_dict()
    for fqn, t in model.state_dict().items():
        torch.testing.assert_close(t, want[fqn], atol=ATOL, rtol=ATOL, msg=lambda m: f"{fqn} loaded on one device: {m}")
