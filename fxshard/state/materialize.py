"""``fxshard.materialize``: give a model transformed on the meta device this rank's
shards, initialised by the model's own init.

Example::

    with torch.device("meta"):
        model = LlamaForCausalLM(config)             # no memory
    sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": ids})
    torch.manual_seed(0)
    fxshard.materialize(sharded, model, device="cuda")   # HF's own init, this rank's slices only

**What is reproduced.**  The init runs as the model wrote it (HF ``initialize_weights``,
torchtitan ``init_states``, or any callable), on the single-device module tree, in its
own order, drawing from the same random stream; each tensor it writes exists at full
size only while the init works on it (an LRU cache of ``cache_mb``), and is then cut to
this rank's shard.  So with the same seed, every rank's shards equal the slices of
``init(model)`` run on one device -- exactly, for any init, elementwise-random or
fan-based (``kaiming_uniform_`` sees the full shape) -- and the peak is one module's
full tensors, not the model's.  The price: every rank draws the whole model's random
numbers (the time of a single-device init).  A tensor the init leaves alone gets its
module's own init (HF's ``_init_weights`` rule for that module, torchtitan's
``_init_self_parameters``, torch's ``reset_parameters``: then random values are not the
single-device ones, which came from the constructor); one that nothing computes (a
constructor-only ``torch.ones``) is a PlanError naming it.  An init that writes a tensor
again after ``cache_mb`` of others is a PlanError too (raise ``cache_mb``).

Non-persistent buffers (HF's rotary ``inv_freq``, torchtitan's ``freqs_cis``, masks) are
never in a checkpoint: with ``init=None`` they are still recomputed, by the init of
the modules that own them, while parameters are only allocated (for
:func:`fxshard.load_hf_checkpoint` or :func:`fxshard.load`).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from fxshard.runtime import collectives
from fxshard.errors import PlanError
from fxshard.meta import program_meta
from fxshard.state.module_state import attribute_tensors, named_state
from fxshard.state.shards import assemble, runs_of

AUTO = "auto"


def materialize(sharded: fx.GraphModule, model: nn.Module, *, device: str | torch.device = "cpu",
                init: Callable[[nn.Module], None] | str | None = AUTO, cache_mb: float = 1024) -> fx.GraphModule:
    """Allocate ``sharded``'s local shards on ``device`` and initialise them (in place;
    returns ``sharded``).

    ``model`` is the single-device model ``sharded`` was transformed from (on the meta
    device; it is not modified).  ``init``: ``"auto"`` is the model's own init (HF
    ``initialize_weights``, torchtitan ``init_states``, else every module's
    ``reset_parameters``); a callable ``init(module)`` runs on the single-device module
    tree; ``None`` allocates parameters uninitialised (a checkpoint load follows) and
    only recomputes non-persistent buffers.  ``cache_mb``: how many MiB of full tensors
    the init may hold at once (at least the largest one is always allowed).
    """
    if program_meta(sharded).state is None:
        raise PlanError("materialize: this GraphModule was not produced by fxshard.transform")
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    if enabled_local_tensor_mode() is not None:
        raise PlanError("materialize runs on real ranks (or an offline MeshSpec), not under LocalTensorMode")
    device = torch.device(device)
    mesh = collectives.bound_mesh()
    unvalued = {fqn for fqn, t, _ in named_state(sharded) if t.is_meta}
    _allocate(sharded, device)
    replay = _InitReplay(sharded, model, mesh, device, int(cache_mb * 2**20))
    if init is not None:
        replay.run(_auto_init(replay.model) if init == AUTO else init, None)
    # what the init left alone (with init=None: the non-persistent buffers, never in a
    # checkpoint): the owning modules' own init, written only where nothing was
    left = replay.unwritten(persistent=None if init is not None else False)
    replay.run(_fallback_init({fqn.rpartition(".")[0] for fqn in left}), set(left))
    replay.check(replay.unwritten(persistent=None if init is not None else False))
    # a meta tensor of the program that is no tensor of the model (a constant torch.export
    # lifted, a tensor torch.fx folded): nothing could compute it
    orphans = sorted(unvalued - replay.targeted())
    if orphans:
        raise PlanError(f"materialize: {orphans[:8]} are tensors of the program that the model does not hold (constants "
                        f"computed while capturing, on the meta device), so no init can compute them\n  fix: make them "
                        f"buffers or attributes of the model (self.mask = ... in __init__), or transform a model built "
                        f"on a real device")
    return sharded


def _allocate(gm: nn.Module, device: torch.device) -> None:
    """Every meta tensor gets (uninitialised) storage on ``device``, other tensors move
    there; tied tensors stay tied, parameters stay parameters."""
    from torch.distributed.tensor import DTensor

    new: dict[int, torch.Tensor] = {}
    for fqn, t, is_param in named_state(gm):
        if isinstance(t, DTensor):
            raise PlanError(f"materialize: {fqn} is already sharded by FSDP2; call fxshard.materialize before "
                            f"fxshard.fully_shard")
        if id(t) not in new:
            data = torch.empty_like(t, device=device) if t.is_meta else t.detach().to(device)
            new[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
        owner_path, _, name = fqn.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        (owner._parameters if is_param else owner._buffers)[name] = new[id(t)]


def _auto_init(model: nn.Module) -> Callable[[nn.Module], None]:
    if hasattr(model, "initialize_weights") and hasattr(model, "_init_weights"):  # HF PreTrainedModel
        return lambda m: m.initialize_weights()
    if hasattr(model, "init_states"):  # torchtitan
        return lambda m: m.init_states()
    if hasattr(model, "init_weights") and callable(model.init_weights):
        return lambda m: m.init_weights()

    def reset(m: nn.Module) -> None:
        for sub in m.modules():
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
    return reset


def _fallback_init(owners: set[str]) -> Callable[[nn.Module], None]:
    """The init of just the modules ``owners`` (FQNs): HF's rule for one module,
    torchtitan's per-module state init, else torch's ``reset_parameters`` (a torch
    layer's constructor init: ones for a norm's weight, fan-based random for a linear)."""
    def run(m: nn.Module) -> None:
        for name, sub in m.named_modules():
            if name not in owners:
                continue
            if hasattr(m, "_init_weights") and hasattr(m, "initialize_weights"):  # HF
                m._init_weights(sub)
            elif hasattr(sub, "_init_self_parameters"):  # torchtitan
                sub._init_self_parameters()
                sub._init_self_buffers()
            elif hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
    return run


class _Target:
    """One tensor of the single-device model (all its FQNs): its full value exists
    while the init works on it, then it is cut into the shards."""

    __slots__ = ("fqns", "shape", "dtype", "real", "flushed", "persistent")

    def __init__(self, fqns, t, persistent):
        self.fqns, self.shape, self.dtype = fqns, tuple(t.shape), t.dtype
        self.real, self.flushed, self.persistent = None, False, persistent


class _Shadow(torch.Tensor):
    """Stands for a tensor of the single-device model during the init: reports its
    shape, dtype and the target device (so ``is_meta`` shortcuts in ``nn.init`` do not
    skip it), and runs every op on the full value, allocated on first use."""

    @staticmethod
    def __new__(cls, replay: "_InitReplay", target: _Target, like: torch.Tensor, real: torch.Tensor | None = None):
        ref = real if real is not None else like
        s = torch.Tensor._make_wrapper_subclass(cls, ref.shape, strides=ref.stride(), dtype=ref.dtype,
                                                device=replay.device, storage_offset=ref.storage_offset(),
                                                requires_grad=False)
        s._replay, s._target, s._view = replay, target, real
        return s

    def __repr__(self):
        return f"_Shadow({self._target.fqns[0]}, shape={tuple(self.shape)})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default and args[0]._view is None:
            return _Shadow(args[0]._replay, args[0]._target, args[0])  # nn.Parameter(shadow): allocates nothing
        shadows = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, _Shadow)]
        replay = shadows[0]._replay
        unwrapped = {id(s): replay.value(s) for s in shadows}
        out = func(*tree_map(lambda a: unwrapped[id(a)] if isinstance(a, _Shadow) else a, args),
                   **tree_map(lambda a: unwrapped[id(a)] if isinstance(a, _Shadow) else a, kwargs))
        # an output aliasing a target (in-place result, view) stays a shadow of it
        def wrap(r):
            if not isinstance(r, torch.Tensor):
                return r
            for s in shadows:
                if r is unwrapped[id(s)]:
                    return s
                if s._target.real is not None and r.untyped_storage().data_ptr() == s._target.real.untyped_storage().data_ptr():
                    return _Shadow(replay, s._target, r, real=r)
            return r
        return tree_map(wrap, out)


class _InitReplay:
    """The single-device module tree with a shadow for each tensor, and the LRU of full
    values being initialised."""

    def __init__(self, gm, model, mesh, device, cache_bytes):
        if any(not t.is_meta for _, t, _ in named_state(model)):
            raise PlanError("materialize: pass the model fxshard.transform was given, on the meta device "
                            "(with torch.device('meta'): model = ...)")
        self.gm, self.mesh, self.device, self.cache_bytes = gm, mesh, device, cache_bytes
        self.model = copy.deepcopy(model)  # free on meta; the init may reassign attributes
        self.local = {fqn: t for fqn, t, _ in named_state(gm)}
        self.targets: dict[int, _Target] = {}
        self.shadows: dict[int, _Shadow] = {}
        self.live: OrderedDict[int, _Target] = OrderedDict()  # LRU of full values
        self.live_bytes = 0
        self.written: set[str] = set()
        for fqn, t, is_param in named_state(self.model):
            owner, _, leaf = fqn.rpartition(".")
            persistent = is_param or leaf not in self.model.get_submodule(owner)._non_persistent_buffers_set
            if id(t) in self.targets:
                self.targets[id(t)].fqns.append(fqn)
            else:
                self.targets[id(t)] = _Target([fqn], t, persistent)
                shadow = _Shadow(self, self.targets[id(t)], t)
                self.shadows[id(t)] = nn.Parameter(shadow, requires_grad=t.requires_grad) if is_param else shadow
        self._install(self.model, {id(t): self.shadows[id(t)] for _, t, _ in named_state(self.model)})
        # plain tensor attributes (``self.mask = ...``, a table ``setup_caches()`` assigns): the
        # program holds them as non-persistent buffers under the same FQNs; those on the meta
        # device are computed like any non-persistent buffer (the init writes or assigns them)
        for fqn, t in attribute_tensors(self.model):
            if fqn not in self.local or not t.is_meta:
                continue  # a real one was moved to the device with its value by _allocate
            owner, _, leaf = fqn.rpartition(".")
            if id(t) in self.targets:
                self.targets[id(t)].fqns.append(fqn)
            else:
                self.targets[id(t)] = _Target([fqn], t, False)
                self.shadows[id(t)] = _Shadow(self, self.targets[id(t)], t)
            setattr(self.model.get_submodule(owner), leaf, self.shadows[id(t)])

    @staticmethod
    def _install(model, by_id):
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for name, t in store.items():
                    if t is not None and id(t) in by_id:
                        store[name] = by_id[id(t)]

    def value(self, s: _Shadow) -> torch.Tensor:
        t = s._target
        if t.flushed and self._writes(t):
            raise PlanError(f"materialize: the init used {t.fqns[0]} again after it had been cut into shards (it held "
                            f"{self.cache_bytes / 2**20:.0f} MiB of other full tensors in between)\n"
                            f"  fix: pass a larger cache_mb= to fxshard.materialize")
        if t.real is None:
            t.real = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            self.live_bytes += t.real.numel() * t.real.element_size()
        self.live[id(t)] = t
        self.live.move_to_end(id(t))
        while self.live_bytes > self.cache_bytes and len(self.live) > 1:
            _, oldest = next(iter(self.live.items()))
            self._flush(oldest)
        return t.real if s._view is None else s._view

    def _writes(self, t: _Target) -> bool:
        return self.writable is None or any(f in self.writable for f in t.fqns)

    def _flush(self, t: _Target, value: torch.Tensor | None = None) -> None:
        """Cut the full value into this rank's shards (of the FQNs this pass may write)."""
        value = t.real if value is None else value
        if tuple(value.shape) != t.shape:
            raise PlanError(f"materialize: the init gave {t.fqns[0]} the shape {tuple(value.shape)}, the model's is "
                            f"{t.shape}\n  fix: the init must compute the tensor the model was built with")
        for fqn in t.fqns:
            local = self.local.get(fqn)
            if local is not None and (self.writable is None or fqn in self.writable):  # absent: another rank's expert
                src = value.to(local.dtype)
                assemble(runs_of(self.gm, fqn, self.mesh, local), lambda box: src[box.glob], local.data)
                self.written.add(fqn)
        if t.real is not None:
            self.live_bytes -= t.real.numel() * t.real.element_size()
        self.live.pop(id(t), None)
        t.real, t.flushed = None, True

    def run(self, init: Callable[[nn.Module], None], writable: set[str] | None) -> None:
        """Run ``init`` on the single-device tree; write the FQNs in ``writable`` (all: None)."""
        if writable is not None and not writable:
            return
        self.writable = writable
        for t in self.targets.values():
            t.flushed = False
        with torch.no_grad():
            init(self.model)
        for t in list(self.live.values()):
            self._flush(t)
        # tensors the init assigned instead of writing (``self.freqs_cis = ...``)
        assigned = [(fqn, v) for fqn, v, _ in named_state(self.model)] + attribute_tensors(self.model)
        for fqn, v in assigned:
            if fqn in self.written or isinstance(v, _Shadow) or fqn not in self.local:
                continue
            target = next((t for t in self.targets.values() if fqn in t.fqns), None)
            if target is not None:  # (a real attribute tensor was moved by _allocate, value and all)
                self._flush(target, v.detach())

    def targeted(self) -> set[str]:
        """FQNs of the model's tensors (all their names)."""
        return {fqn for t in self.targets.values() for fqn in t.fqns}

    def unwritten(self, persistent: bool | None) -> list[str]:
        """FQNs of this rank's tensors nothing has written yet (``persistent``: only those
        that are / are not in ``state_dict``; None: all)."""
        return [fqn for t in self.targets.values() for fqn in t.fqns
                if fqn in self.local and fqn not in self.written and (persistent is None or t.persistent == persistent)]

    @staticmethod
    def check(need: list[str]) -> None:
        if need:
            raise PlanError(f"materialize: nothing computed {need[:8]}{' ...' if len(need) > 8 else ''}: the init neither "
                            f"wrote nor assigned them, and their modules have no init of their own (reset_parameters)\n"
                            f"  fix: pass init= a callable that also initialises them; it receives the single-device "
                            f"module tree (e.g. `nn.init.ones_(m.ln.weight)`, `m.freqs_cis = precompute(...)`)")
