"""Gradient accumulation with ``fxshard.no_sync``: k micro-batches, one sync per bucket, and
a training loop (accumulation 2, clipping, AdamW, 3 steps) equal to one device on the whole
batch, at dp x tp with fxshard summing over dp and with FSDP2 over dp (its gradients held
unsharded between passes, or reduce-scattered every pass and accumulated sharded), on real gloo."""
import contextlib
import copy

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import fxshard
from harness import make_mesh, spawn

STEPS, ACCUM, LR, MAX_NORM = 3, 2, 1e-2, 0.5
TOL = dict(rtol=1e-4, atol=1e-5)
# AdamW normalizes each element's step, so an element whose gradient is at round-off level moves by a
# round-off-sized fraction of lr (1e-2): parameters are compared to 1e-4, which any wrong gradient exceeds
PARAM_TOL = dict(rtol=1e-4, atol=1e-4)


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _batch(step: int):
    """The global batch of a step: 8 rows, 2 per (dp rank, micro-batch); the prompt masked."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 128, (8, 8), generator=g)
    labels = torch.randint(3, 128, (8, 8), generator=g)
    labels[:, :2] = -100  # as many scored tokens in every row: the mean of the means is the mean
    return ids, labels


class _AllReduces(TorchDispatchMode):
    """Counts all-reduces per process group."""

    def __init__(self):
        super().__init__()
        self.groups = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_reduce.default:
            self.groups.append(args[2])
        return func(*args, **(kwargs or {}))


def _one_device(model):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids, labels = _batch(step)
        opt.zero_grad()
        loss = sum(model(input_ids=i, labels=l).loss for i, l in zip(ids.chunk(4), labels.chunk(4))) / 4
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), model.state_dict()


def _token_loss(logits, labels):
    """HF's causal-LM loss, computed outside the graph on this rank's rows."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _accumulated(sharded, scale: float, dp_group: str, in_graph_loss: bool, sharded_grads: bool = False):
    """The same loop on this rank's rows, ``ACCUM`` micro-batches per step; returns the
    logged losses and, per micro-batch, how many all-reduces ran on the dp group (with
    ``sharded_grads``, FSDP2's: each parameter holds its sharded gradient after the first pass)."""
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    losses, dp_reduces = [], []
    for step in range(STEPS):
        ids, labels = _batch(step)
        if in_graph_loss:
            _, mine = fxshard.shard_inputs(sharded, input_ids=ids, labels=labels)
        else:  # labels are no input of the graph: this rank's rows by the same cut as its ids
            _, mine = fxshard.shard_inputs(sharded, input_ids=ids)
            mine["labels"] = labels.chunk(2)[fxshard.bound_mesh().get_local_rank("dp")]
        micro = list(zip(mine["input_ids"].chunk(ACCUM), mine["labels"].chunk(ACCUM)))
        opt.zero_grad()
        total = 0.0
        for k, (i, l) in enumerate(micro):
            last = k == ACCUM - 1
            held = fxshard.no_sync(sharded, sharded_grads=sharded_grads)
            with contextlib.nullcontext() if last else held, _AllReduces() as seen:
                loss = (sharded(input_ids=i, labels=l).loss if in_graph_loss
                        else _token_loss(sharded(input_ids=i).logits, l)) / ACCUM
                (loss * scale).backward()
            dp_reduces.append(seen.groups.count(dp_group))
            if k == 0 and in_graph_loss:  # FSDP2: reduce-scattered into the sharded .grad, or held unsharded
                assert all((p.grad is not None) == sharded_grads for p in sharded.parameters()), sharded_grads
            total = total + loss.detach()
        fxshard.clip_grad_norm_(sharded, MAX_NORM)
        opt.step()
        losses.append(fxshard.reduce_over(total, op="avg"))
    return torch.stack(losses), dp_reduces


def _check(rank: int, world_size: int) -> None:
    mesh = make_mesh({"dp": 2, "tp": 2})
    dp_group = mesh.get_group("dp").group_name
    model = _llama()
    want_losses, want_state = _one_device(model)
    batch = {"input_ids": {"dp": Shard(0)}, "labels": {"dp": Shard(0)}}
    example = dict(zip(("input_ids", "labels"), _batch(99)))

    # fxshard sums the gradients over dp (the batch-sharded axis): each rank scales its loss by 1/dp,
    # computed outside the graph (a mean loss in the graph over a batch-sharded axis is refused)
    plan = fxshard.Plan.from_hf(mesh, model).replace(inputs={"input_ids": {"dp": Shard(0)}})
    sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": example["input_ids"]})
    losses, dp_reduces = _accumulated(sharded, 0.5, dp_group, in_graph_loss=False)
    assert runtime_held() == 0
    torch.testing.assert_close(losses, want_losses, **TOL)
    full = fxshard.full_state_dict(sharded)
    for name, t in want_state.items():
        torch.testing.assert_close(full[name], t, **PARAM_TOL, msg=lambda m: f"fxshard dp: {name}: {m}")
    # the micro-batch inside no_sync syncs nothing over dp; the last one syncs every bucket once
    assert dp_reduces[0::2] == [0] * STEPS and min(dp_reduces[1::2]) > 0, dp_reduces

    # FSDP2 over dp: it averages over dp itself, and skips its reduce-scatter inside no_sync
    plan = fxshard.Plan.from_hf(mesh, model).replace(inputs=batch, fsdp="dp")
    sharded = fxshard.fully_shard(fxshard.transform(model, plan, example_kwargs=example), mesh)
    losses, _ = _accumulated(sharded, 1.0, dp_group, in_graph_loss=True)
    torch.testing.assert_close(losses, want_losses, **TOL)
    full = fxshard.full_state_dict(sharded)
    for name, t in want_state.items():
        torch.testing.assert_close(full[name], t, **PARAM_TOL, msg=lambda m: f"FSDP2: {name}: {m}")

    # FSDP2 reduce-scattering every pass, its gradients accumulating sharded (torchtitan's)
    sharded = fxshard.fully_shard(fxshard.transform(model, plan, example_kwargs=example), mesh)
    losses, _ = _accumulated(sharded, 1.0, dp_group, in_graph_loss=True, sharded_grads=True)
    torch.testing.assert_close(losses, want_losses, **TOL)
    full = fxshard.full_state_dict(sharded)
    for name, t in want_state.items():
        torch.testing.assert_close(full[name], t, **PARAM_TOL, msg=lambda m: f"FSDP2 sharded grads: {name}: {m}")


def runtime_held() -> int:
    from fxshard.runtime.collectives import held_back
    return held_back()


def test_no_sync_accumulation_real_gloo():
    spawn(_check, 4)
