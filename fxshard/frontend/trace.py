"""Tracing a model into the graph fxshard rewrites.

``trace`` is ``torch.fx.symbolic_trace`` with three additions: the plan's opaque
regions stay leaf ``call_module`` nodes, every argument and output of a planned
module that is traced through gets a boundary marker (so its layouts have an edge to
live on), and global shapes are recorded by fake-tensor propagation.  Each node keeps
its ``nn_module_stack`` and ``stack_trace`` for regions and error messages.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch._subclasses.fake_tensor import FakeTensorMode

from fxshard.markers import mark_arguments, mark_outputs, region_input, region_output
from fxshard.errors import PlanError
from fxshard.meta import program_meta
from fxshard.state.module_state import attributes_as_buffers, register_attribute_buffers


class ShardTracer(fx.Tracer):
    """fx tracer that keeps opaque plan regions as leaves and marks planned module
    boundaries with ``region_input`` / ``region_output``."""

    def __init__(self, plan=None):
        super().__init__()
        self.proxy_buffer_attributes = True
        self.record_stack_traces = True
        self.plan = plan

    def _spec(self, fqn: str):
        if self.plan is None:
            return None
        hit = self.plan.match(fqn)
        return hit[1] if hit else None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        spec = self._spec(qualname)
        if spec is not None and spec.local:
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward, args, kwargs):
        fqn = self.path_of_module(m)
        spec = self._spec(fqn)
        if spec is None or not spec.declares_boundary() or self.is_leaf_module(m, fqn):
            return super().call_module(m, forward, args, kwargs)
        # inputs and outputs are marked by argument / output name
        def mark(marker):
            def one(v, name):
                return self.create_proxy("call_function", marker, (v, fqn, name), {}) if isinstance(v, fx.Proxy) else v
            return one

        def marked_forward(*args, **kwargs):
            # inside the module's scope, so the markers' nn_module_stack names the module
            # (and its type) even when it has no op of its own
            args, kwargs = mark_arguments(m, fqn, args, kwargs, mark(region_input))
            return mark_outputs(forward(*args, **kwargs), fqn, spec.out_names, mark(region_output))

        return super().call_module(m, marked_forward, args, kwargs)


CAPTURES = ("auto", "fx", "export", "export-every-block")


def trace(model: nn.Module, plan=None, example_inputs: Sequence[Any] = (), example_kwargs: dict | None = None, *,
          capture: str = "auto", dynamic_shapes=None) -> fx.GraphModule:
    """Capture ``model`` into the graph fxshard rewrites.

    Example::

        gm = fxshard.trace(model, plan, (tokens,))
        print(gm.code)   # region_input/region_output mark the planned modules

        gm = fxshard.trace(hf_model, plan, example_kwargs={"input_ids": ids, "labels": labels})

    ``capture``: ``"fx"`` is ``torch.fx.symbolic_trace`` (readable graphs of models
    written to be traced, opaque local regions kept as modules); ``"export"`` is
    non-strict ``torch.export`` (:mod:`fxshard.frontend.capture`: any model export can
    capture, HF transformers and torchtitan among them; batch and sequence stay dynamic,
    ``dynamic_shapes`` overrides which dims); ``"auto"`` tries fx first and exports
    when symbolic tracing fails or keyword inputs are given.  Export captures the first
    blocks of a deep model's stack of repeated blocks and stamps the others
    (:mod:`fxshard.frontend.repeated_blocks`, checked; ``ProgramMeta.capture_blocks`` says
    what was done); ``"export-every-block"`` exports every block.  ``example_inputs`` /
    ``example_kwargs`` are the single-device (global) inputs; when given, every node's
    ``meta["val"]`` holds a fake tensor with its global shape.  The model is not modified.
    Plain tensor attributes the graph reads (``self.mask = torch.tril(...)``, constants
    export lifts) become non-persistent buffers under the model's FQNs
    (:func:`fxshard.state.module_state.register_attribute_buffers`): ``state_dict`` keys stay
    the model's, and ``.to(device)``, ``materialize`` and the plan's layouts reach them.
    """
    if capture not in CAPTURES:
        raise PlanError(f"trace: capture={capture!r}; use one of {CAPTURES}")
    with _model_state_kept(model):
        return _trace(model, plan, example_inputs, example_kwargs, capture, dynamic_shapes)


def _trace(model: nn.Module, plan, example_inputs, example_kwargs, capture: str, dynamic_shapes) -> fx.GraphModule:
    if capture == "fx" or (capture == "auto" and not example_kwargs):
        try:
            gm = _fx_trace(model, plan)
        except PlanError:
            raise
        except Exception as e:  # control flow on proxies, unpacked shapes, ...: not fx-traceable
            if capture == "fx":
                raise PlanError(f"torch.fx.symbolic_trace cannot trace {type(model).__name__}: {type(e).__name__}: {e}; "
                                f"use capture='export' (torch.export) instead") from e
            gm = None
        if gm is not None:
            register_attribute_buffers(gm, model)
            if example_inputs or example_kwargs:
                from fxshard.frontend.capture import flat_inputs

                record_shapes(gm, flat_inputs(gm, example_inputs, example_kwargs))
            _record_model(gm, model)
            return gm
    from fxshard.frontend.capture import capture as export_capture, flat_inputs
    from fxshard.frontend.static_sizes import record_input_dim_ranges

    gm = export_capture(model, plan, example_inputs, example_kwargs, dynamic_shapes,
                        repeated_blocks=capture != "export-every-block")
    record_input_dim_ranges(gm)  # before record_shapes makes the shapes concrete
    keep_non_persistent(model, gm)
    register_attribute_buffers(gm, model)
    if example_inputs or example_kwargs:
        record_shapes(gm, flat_inputs(gm, example_inputs, example_kwargs))
    _record_model(gm, model)
    return gm


_MODULE_SLOTS = frozenset(vars(nn.Module()))  # nn.Module's own attributes: parameters, buffers, hooks, training


@contextlib.contextmanager
def _model_state_kept(model: nn.Module):
    """Capture leaves the model as it found it.  A model that fills a cache on its forward
    (OLMo-core's rotary embedding keeps its sine and cosine tables in a dict-like
    ``BufferCache`` it fills on the first call; a ``self.cache = ...`` set lazily) fills it
    with fake tensors or proxies while it is traced; left there, the next capture finds a
    fake tensor among its constants ("We found a fake tensor in the exported program
    constant's list") and an eager call computes with it.  Every module attribute that the
    capture added or replaced, and every entry of a dict-like attribute it changed, is put
    back afterwards (the captured graph computes the table itself, or holds its own copy)."""
    from collections.abc import MutableMapping

    saved = []
    for mod in model.modules():
        attrs = {k: v for k, v in vars(mod).items() if k not in _MODULE_SLOTS}
        maps = {k: dict(v.items()) for k, v in attrs.items() if isinstance(v, (dict, MutableMapping))
                and not isinstance(v, nn.Module)}
        saved.append((mod, attrs, maps))
    try:
        yield
    finally:
        for mod, attrs, maps in saved:
            now = vars(mod)
            for k in [k for k in now if k not in _MODULE_SLOTS and k not in attrs]:
                del now[k]
            for k, v in attrs.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
            for k, before in maps.items():
                m = attrs[k]
                try:
                    if dict(m.items()).keys() != before.keys() or any(m[key] is not v for key, v in before.items()):
                        m.clear()
                        m.update(before)
                except Exception:  # noqa: BLE001 - a mapping that cannot be read back as it was written is left alone
                    pass


_MISSING = object()


def _record_model(gm: fx.GraphModule, model: nn.Module) -> None:
    """What later steps need to know of the model, not of its graph: its ModuleDicts,
    class and HF ``model_type`` (checkpoint key renames are per class / model type)."""
    program = program_meta(gm, create=True)
    program.module_dicts = _module_dicts(model)
    program.model_class = type(model).__name__
    program.model_type = getattr(getattr(model, "config", None), "model_type", None)


def _module_dicts(model: nn.Module) -> list[str]:
    """FQNs of the model's ``nn.ModuleDict`` s (torchtitan keeps its blocks in one): a
    GraphModule rebuilds plain modules, and ``split_blocks`` gives the blocks' parent its
    container type back."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.ModuleDict)]


def _fx_trace(model: nn.Module, plan) -> fx.GraphModule:
    tracer = ShardTracer(plan)
    if not isinstance(model, nn.Module):
        graph = tracer.trace(model)
        return fx.GraphModule(tracer.root, graph, model.__name__)
    # plain tensor attributes read by name, as buffers are (not folded into constants); the
    # model left as it was (a cache filled on the first call would keep a Proxy, the tracer
    # adds its constants as ``_tensor_constantN``)
    with _attributes_restored(model), attributes_as_buffers(model):
        graph = tracer.trace(model)
        gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
        keep_non_persistent(tracer.root, gm)
    program_meta(gm, create=True).captured_by = "torch.fx"
    return gm


@contextlib.contextmanager
def _attributes_restored(model: nn.Module):
    """Every module of ``model`` gets back the plain attributes it had before the block
    (what the block assigned is undone, what it added is removed)."""
    before = [(mod, dict(vars(mod))) for mod in model.modules()]
    try:
        yield
    finally:
        for mod, attrs in before:
            now = vars(mod)
            for key in [k for k in now if k not in attrs]:
                del now[key]
            for key, value in attrs.items():
                if now.get(key, _MISSING) is not value:
                    now[key] = value


_MISSING = object()


def keep_codegen(src: fx.GraphModule, dst: fx.GraphModule) -> None:
    """Carry a captured graph's pytree calling convention (``model(input_ids=...)`` in,
    the model's ``ModelOutput`` out) over to a copy of it."""
    dst.graph._codegen = src.graph._codegen  # read-only: the in/out specs of the model's call
    if hasattr(src, "_in_spec"):
        dst._in_spec = src._in_spec
    if hasattr(src, "_out_spec"):
        dst._out_spec = src._out_spec
    dst.recompile()


def keep_non_persistent(src: nn.Module, gm: fx.GraphModule) -> None:
    """Mark ``gm``'s buffers non-persistent where ``src``'s are: ``fx.GraphModule``
    re-registers every buffer as persistent, which would add keys such as a rotary
    table to ``state_dict`` and break loading the model's own checkpoints."""
    for prefix, mod in src.named_modules():
        for name in mod._non_persistent_buffers_set:
            fqn = f"{prefix}.{name}" if prefix else name
            owner_path, _, leaf = fqn.rpartition(".")
            try:
                owner = gm.get_submodule(owner_path) if owner_path else gm
            except AttributeError:
                continue
            if leaf in owner._buffers:
                owner._non_persistent_buffers_set.add(leaf)


def record_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Run ``gm`` on fake copies of ``example_inputs`` and store each node's fake value
    in ``node.meta["val"]`` (global shapes and dtypes)."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        # a model on the meta device runs on meta inputs (the shapes are all that is recorded)
        on_meta = any(t.is_meta for t in gm.parameters()) or any(t.is_meta for t in gm.buffers())
        # a fresh fake per input, never one per storage: the same tensor passed twice (``labels=ids``),
        # a view of another input or a parameter passed as an input are distinct inputs of the program
        fakes = [_fresh_fake(mode, x, on_meta) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        try:
            _ShapeProp(gm, mode).propagate_dont_convert_inputs(*fakes)
        except PlanError:
            raise  # names the node that failed
        except Exception as e:
            raise PlanError(f"running the model on the example inputs failed while recording shapes: {e}") from e


def _shape_error(node: fx.Node, e: Exception) -> PlanError:
    from torch._subclasses.fake_tensor import DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from fxshard.errors import node_error

    if isinstance(e, (DynamicOutputShapeException, GuardOnDataDependentSymNode)):
        return node_error(node, f"the shape of its result depends on the values of its input ({type(e).__name__}: "
                                f"{_first_line(e)}; e.g. `torch.where(mask)`, `nonzero`, boolean indexing), which "
                                f"fxshard cannot lay out before the run",
                          "declare the module that computes it an opaque region run on real tensors "
                          "(ModuleSpec(local=True); for an MoE block fxshard.expert_parallel or fxshard.routed_experts), "
                          "or compute it with static shapes (a dense mask instead of the indices)")
    return node_error(node, f"running the model on the example inputs failed here while recording shapes: "
                            f"{type(e).__name__}: {_first_line(e)}",
                      "check that the example inputs are ones the model accepts (shapes, dtypes, devices)")


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def _fresh_fake(mode: FakeTensorMode, x: torch.Tensor, on_meta: bool) -> torch.Tensor:
    """A fake tensor shaped like ``x`` that shares storage with nothing (``from_tensor``
    memoizes per tensor and keeps views of one base on one fake storage)."""
    with mode:
        fake = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta" if on_meta else x.device)
    return fake.requires_grad_(x.requires_grad) if x.requires_grad else fake


class _ShapeProp(FakeTensorProp):
    """FakeTensorProp, except that a leaf module that cannot run on fake tensors (data-
    dependent shapes, e.g. MoE routing in a local region) runs once on zero-filled real
    tensors of the same shapes, and its outputs are recorded as fake tensors.  A node
    that fails is named in the PlanError, with its source line."""

    def __init__(self, gm, mode):
        super().__init__(gm, mode)
        self.extra_traceback = False  # the PlanError names the node and its source line

    def run_node(self, n: fx.Node):
        try:
            return super().run_node(n)
        except PlanError:
            raise
        except Exception as e:
            raise _shape_error(n, e) from e

    def call_module(self, target, args, kwargs):
        from fxshard.runtime.routed_experts import follows_hf_experts, grouped_experts_forward

        module = self.fetch_attr(target)
        if follows_hf_experts(module):  # routed experts run fxshard's grouped GEMMs (shapes on meta in any dtype)
            return grouped_experts_forward(module, *args, **kwargs)
        try:
            with _quiet_fake_kernels():
                return super().call_module(target, args, kwargs)
        except Exception:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.utils._pytree import tree_map

            def real(a):
                return torch.zeros(a.shape, dtype=a.dtype, device=a.device) if isinstance(a, torch.Tensor) else a

            with unset_fake_temporarily(), torch.no_grad():
                out = self.fetch_attr(target)(*tree_map(real, args), **tree_map(real, kwargs))
            return tree_map(lambda t: self._mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, out)


@contextlib.contextmanager
def _quiet_fake_kernels():
    """FakeTensorMode logs a traceback for a kernel without a fake implementation (HF's
    CPU grouped_mm on float32) before raising; the fallback above handles it."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    old = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = old
