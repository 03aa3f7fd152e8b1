"""Run a rank's program without the ranks: torch's fake process group and the meta device.

The planner needs what a program *does* on one rank (the tensors its backward keeps, its
FLOPs, the bytes its kernels move), not its values.  :func:`offline_mesh` makes a real
``DeviceMesh`` over torch's fake process group in this process (collectives are shapes
only, no peer exists), so ``fxshard.transform`` binds the mesh as on a real rank (rank 0's
view); :func:`measure_forward` then runs the program's forward on meta tensors
(nothing is allocated) and counts, per unit (the part before the first block, each block,
the part after the last block with the loss):

- ``saved``: bytes of the unique storages autograd keeps for the backward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters and buffers excluded, each
  counted where it was *made* (a block's output, kept by the next block, is the block's);
  ``shared``: storages made before the blocks that blocks keep (rotary tables, masks: a
  later pipeline stage receives and keeps them too);
- ``matmul_flops`` (``torch.utils.flop_counter``'s formulas, attention included; attention's
  alone in ``attention_flops``),
  ``other_bytes`` (bytes read and written by every other kernel that is not a view) and
  ``kernels``, and the same once inductor fuses the ops between two matmuls (``fused_bytes``,
  ``fused_kernels``: what ``torch.compile`` runs, ``fusion.py``);
- for selective activation checkpointing, per block, what the trainer's op policy
  (``fxshard.training.checkpointing.selective_policy``, asked about every op as the checkpoint
  asks it) keeps: ``selective_saved``, the bytes of the unique storages its saved ops output
  (matmuls but every other ``mm``, attention, collectives), and what the recomputation
  skips because of them (``selective_skip_flops``, ``_bytes``, ``_kernels``);
- ``backward_working`` (the part after the blocks): the peak bytes its backward makes, run
  alone from the loss to the last block's output and the head's own parameters: the loss's
  gradients of the logits (in fp32 when the loss upcasts), alive together at the start of the
  step's backward, when every block's kept tensors are too (the step's peak in a language model).

Attention runs as on a device: on the meta device ``scaled_dot_product_attention`` would take
the math path and keep the ``[b, h, s, s]`` probabilities, which flash and memory-efficient
attention never keep; here it keeps what they keep: q, k, v, the output, the log-sum-exp
(fp32) and a given mask converted to the query's dtype.

Example::

    with offline_mesh({"tp": 2}) as mesh:
        program = fxshard.transform(model, plan_over(mesh), example_kwargs=kw, blocks="auto")
        counts = measure_forward(program, "input_ids", rows=2, seq=128, loss=token_loss_sum)
"""
from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from fxshard.errors import PlanError
from fxshard.planner.fusion import FusedKernels, storage_key, tensor_bytes
from fxshard.runtime.collectives import bind_mesh
from fxshard.training.checkpointing import selective_policy

BEFORE, AFTER = "<before>", "<after>"


class _Forward:
    """What a checkpoint's policy is asked with (``SelectiveCheckpointContext``): the forward, not the recomputation."""

    is_recompute = False


_FORWARD = _Forward()


def refuse_if_distributed() -> None:
    """The fake process group would replace this process's real one."""
    if dist.is_initialized():
        raise PlanError("fxshard.plan_parallelism runs each candidate on torch's fake process group, and this process "
                        "already has a process group\n  fix: plan before torch.distributed.init_process_group (every "
                        "rank gets the same answer), or in another process: python -m fxshard plan ...")


@contextlib.contextmanager
def offline_mesh(sizes: dict[str, int]) -> Iterator:
    """A ``DeviceMesh`` of ``sizes`` (``None`` when empty) over torch's fake process group,
    in this process, for the block; the process group is destroyed on exit and the mesh fxshard
    had bound before is bound again.  Refused while a real process group exists (the fake one
    would replace it)."""
    refuse_if_distributed()
    # registers torch's "fake" backend: collectives of shapes only, one process plays rank 0
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh

    previous = bind_mesh(None)
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=max(1, math.prod(sizes.values())))
    try:
        yield init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes)) if sizes else None
    finally:
        dist.destroy_process_group()
        try:
            bind_mesh(previous)
        except RuntimeError:  # its process group is gone since (a finished run's or test's): nothing to restore
            bind_mesh(None)


@dataclass
class UnitCounts:
    """What one unit's forward did at one micro-batch size (see the module docstring)."""

    saved: int = 0
    shared: int = 0
    matmul_flops: int = 0
    attention_flops: int = 0  # of matmul_flops: attention's (its kernels run at their own rate)
    other_bytes: int = 0
    kernels: int = 0
    selective_saved: int = 0  # a block under selective checkpointing: its saved ops' outputs
    selective_skip_flops: int = 0  # ... and the FLOPs, bytes and kernels its recomputation skips
    selective_skip_bytes: int = 0
    selective_skip_kernels: int = 0
    backward_working: int = 0  # the part after the blocks: the peak bytes its own backward makes
    fused_bytes: int = 0  # other_bytes and kernels once inductor fuses the ops between the matmuls (fusion.py)
    fused_kernels: int = 0


@dataclass
class ForwardCounts:
    units: dict[str, UnitCounts] = field(default_factory=dict)
    inputs: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)  # per block: (bytes, carries grad) of its tensors

    def unit(self, name: str) -> UnitCounts:
        return self.units.setdefault(name, UnitCounts())


class _DeviceAttention(torch.autograd.Function):
    """``scaled_dot_product_attention`` on meta tensors keeping what flash / memory-efficient
    attention keep (the outputs are empty: shapes only)."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        if q.dim() == 4:  # laid out [b, s, h, d] as the kernels write it: heads.transpose(1, 2) then needs no copy
            out = q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1])).transpose(1, 2)
        else:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        kept = [q, k, v, out, lse]
        if mask is not None:
            kept.append(mask.to(q.dtype) if mask.dtype != q.dtype else mask)
        ctx.save_for_backward(*kept)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


class _Attention(TorchFunctionMode):
    def __init__(self, on_attention: Callable[[int, int, int, list], None]):
        super().__init__()
        self.on_attention = on_attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            # forward: Q K^T and P V, 2 flops each multiply-add; causal kernels skip the masked half
            flops = 4 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1] // (2 if causal else 1)
            moved = sum(t.numel() * t.element_size() for t in (q, k, v)) * 2
            # what a device's attention kernel outputs (saved by selective checkpointing): the output, the lse
            out = math.prod(q.shape[:-1]) * v.shape[-1] * q.element_size() + math.prod(q.shape[:-1]) * 4
            self.on_attention(flops, moved, out, [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor)])
            return _DeviceAttention.apply(q, k, v, mask)
        return func(*args, **kwargs)


_MATMULS = {p for p in flop_registry if "attention" not in str(p)}
_FUSIBLE = {"aten", "prims"}  # inductor fuses these; a collective or a custom op is a kernel of its own
_ALLOCATIONS = {torch.ops.aten.empty, torch.ops.aten.new_empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
                torch.ops.aten.new_empty_strided}


class _Counter(TorchDispatchMode):
    """Kernels, FLOPs and bytes per unit, and which unit made each storage."""

    def __init__(self, counts: ForwardCounts, where: Callable[[], str]):
        super().__init__()
        self.counts, self.where = counts, where
        self.made: dict[int, str] = {}
        self.keep: list[torch.Tensor] = []  # alive until the end: a freed storage's address is not reused
        self.policy = None  # inside a block: the selective checkpointing policy of its forward
        self.selective: set[int] = set()  # storages the policy saves (counted once)
        self.param_storages: set[int] = set()  # the program's parameters: which units read each
        self.param_units: dict[int, set[str]] = {}
        self.fused = FusedKernels()  # the same ops as a compiled program runs them

    def _selective(self, unit: UnitCounts, func, args, kwargs, outs, flops: int, moved: int) -> None:
        """Ask the block's selective-checkpointing policy about this op, as the checkpoint would."""
        if self.policy is None or self.policy(_FORWARD, func, *args, **kwargs) != CheckpointPolicy.MUST_SAVE:
            return
        unit.selective_skip_flops += flops
        unit.selective_skip_bytes += moved
        unit.selective_skip_kernels += 1 if (flops or moved) else 0
        for t in outs:
            if storage_key(t) not in self.selective:
                self.selective.add(storage_key(t))
                unit.selective_saved += t.untyped_storage().nbytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket is torch.ops.aten._grouped_mm and args[0].dtype != torch.bfloat16:
            # MoE experts: the meta kernel of grouped_mm takes bf16 only; the shapes are the same in any dtype
            a, b = args[0], args[1]
            out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs).to(a.dtype)
            unit = self.counts.unit(self.where())
            unit.matmul_flops += 2 * out.numel() * a.shape[-1]
            unit.kernels += 1
            unit.fused_kernels += 1
            self.fused.barrier(self.where(), [t for t in args if isinstance(t, torch.Tensor)])
            self._selective(unit, func, args, kwargs, [out], 2 * out.numel() * a.shape[-1], 0)
            self.made.setdefault(storage_key(out), self.where())
            self.keep.append(out)
            return out
        out = func(*args, **kwargs)
        unit = self.counts.unit(self.where())
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_storages = {storage_key(t) for t in ins}
        for key in in_storages & self.param_storages:
            self.param_units.setdefault(key, set()).add(self.where())
        fresh = [t for t in outs if storage_key(t) not in in_storages]
        packet = func._overloadpacket
        flops = moved = 0
        if packet in _ALLOCATIONS:
            pass  # memory handed out, no kernel
        elif packet in _MATMULS:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            unit.matmul_flops += flops
            unit.kernels += 1
            unit.fused_kernels += 1
            self.fused.barrier(self.where(), ins)
        elif fresh:  # a view makes no kernel and moves nothing
            moved = sum(tensor_bytes(t) for t in ins) + sum(tensor_bytes(t) for t in fresh)
            unit.other_bytes += moved
            unit.kernels += 1
            if func.namespace not in _FUSIBLE:  # a collective, a custom op: its own kernel, compiled or not
                unit.fused_bytes += moved
                unit.fused_kernels += 1
                self.fused.barrier(self.where(), ins)
            else:
                self.fused.kernel(self.where(), ins, fresh)
        if packet not in _ALLOCATIONS:
            self._selective(unit, func, args, kwargs, fresh, flops, moved)
        for t in fresh:
            self.made.setdefault(storage_key(t), self.where())
            self.keep.append(t)
        return out


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes of the storages made while it is on and still alive (a storage
    is freed when its last tensor goes: a weak reference's callback)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, weakref.ref] = {}  # a made storage's weak reference (alive, or its callback never runs)

    def _free(self, key: int, nbytes: int, _ref) -> None:
        self.live -= nbytes
        del self.refs[key]  # its address may be a later storage's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):  # a view (a saved tensor unpacked, detached) makes nothing
            if isinstance(t, torch.Tensor) and storage_key(t) not in self.refs and storage_key(t) not in inputs:
                storage = t.untyped_storage()
                self.live += storage.nbytes()
                self.refs[storage._cdata] = weakref.ref(storage, functools.partial(self._free, storage._cdata,
                                                                                    storage.nbytes()))
        self.peak = max(self.peak, self.live)
        return out


def _backward_working(loss: torch.Tensor, last_output, head_params: list[torch.Tensor]) -> int:
    """The peak bytes of the backward from ``loss`` to the last block's output and the head's
    own parameters (not the blocks': their backward is theirs)."""
    starts = [t for t in tree_leaves(last_output) if isinstance(t, torch.Tensor) and t.requires_grad]
    inputs = starts[:1] + [p for p in head_params if p.requires_grad]
    if not loss.requires_grad or not inputs:
        return 0
    tracker = _LiveBytes()
    with tracker:
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    del grads
    return tracker.peak


def measure_forward(program: torch.nn.Module, input_name: str, rows: int, seq: int,
                    loss: Callable[[object, torch.Tensor], torch.Tensor] | None = None,
                    blocks: list[str] = ()) -> ForwardCounts:
    """Run ``program`` (on the meta device) on ``rows`` x ``seq`` token ids of this rank, then
    ``loss(output, labels)``, counting per unit (``blocks``: the FQNs of the program's block
    submodules, in order)."""
    counts = ForwardCounts()
    state = {"unit": BEFORE, "blocks_done": 0}
    handles = []

    def enter(fqn, args, kwargs):
        state["unit"] = fqn
        counter.policy = selective_policy()  # one per checkpointed forward: it counts the block's matmuls
        counts.inputs[fqn] = [(tensor_bytes(t), t.requires_grad and t.is_floating_point())
                              for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]

    def leave(output) -> None:  # returns None: a forward hook's value would replace the block's output
        state["unit"] = AFTER
        state["last_output"] = output
        counter.policy = None

    for fqn in blocks:
        block = program.get_submodule(fqn)
        handles.append(block.register_forward_pre_hook(lambda m, a, k, fqn=fqn: enter(fqn, a, k), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda m, a, o: leave(o)))
    counter = _Counter(counts, lambda: state["unit"])
    state_storages = {storage_key(t) for t in list(program.parameters()) + list(program.buffers())}
    counter.param_storages = {storage_key(p) for p in program.parameters()}
    saved: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor):
        key = storage_key(t)
        if key not in state_storages and key not in saved:
            made = counter.made.get(key, BEFORE)  # an input made outside the program: the first unit's
            saved[key] = (t.untyped_storage().nbytes(), made)
            if made == BEFORE and state["unit"] != BEFORE:
                counts.unit(BEFORE).shared += t.untyped_storage().nbytes()
        return t

    def on_attention(flops: int, moved: int, out: int, inputs: list) -> None:
        unit = counts.unit(state["unit"])
        unit.matmul_flops += flops
        unit.attention_flops += flops
        unit.other_bytes += moved
        unit.kernels += 1
        unit.fused_bytes += moved  # its own kernel, compiled or not (flash attention)
        unit.fused_kernels += 1
        counter.fused.barrier(state["unit"], inputs)
        if counter.policy is not None:  # the attention kernel's outputs: saved by selective checkpointing
            unit.selective_saved += out
            unit.selective_skip_flops += flops
            unit.selective_skip_bytes += moved
            unit.selective_skip_kernels += 1

    ids = torch.zeros(rows, seq, dtype=torch.long, device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Attention(on_attention), counter:
            out = program(**{input_name: ids})
            if loss is not None:
                state["unit"] = AFTER
                logits = getattr(out, "logits", out)
                value = loss(out, torch.zeros(logits.shape[:-1], dtype=torch.long, device="meta"))
    finally:
        for h in handles:
            h.remove()
    if loss is not None and blocks:
        # the head's own parameters (a tied embedding's gradient would run the blocks' backward)
        head = [p for p in program.parameters() if counter.param_units.get(storage_key(p)) == {AFTER}]
        counts.unit(AFTER).backward_working = _backward_working(value, state.get("last_output"), head)
    for nbytes, made in saved.values():
        counts.unit(made).saved += nbytes
    for name, (nbytes, kernels) in counter.fused.totals().items():
        counts.unit(name).fused_bytes += nbytes
        counts.unit(name).fused_kernels += kernels
    return counts

