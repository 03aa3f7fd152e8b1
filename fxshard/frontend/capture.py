"""Capture with ``torch.export`` (non-strict): the front end for models that
``torch.fx.symbolic_trace`` cannot trace (HF transformers, torchtitan, ...).

Why non-strict ``torch.export`` (and not dynamo's graph capture): it runs the model's
own Python, so HF's decorators, mask-building control flow and shape unpacking just
execute; it names parameters and modules exactly as ``named_parameters()`` /
``named_modules()`` do (dynamo mangles them into placeholders); it keeps the output
structure (an HF ``ModelOutput``) as a pytree spec; and it keeps batch and sequence
symbolic through ``dynamic_shapes``, so sizes stay reads at run time in the graph.
Its aten-level IR is translated back to fxshard's torch-level vocabulary by
:mod:`fxshard.frontend.aten_ops`.

Module boundaries are recovered exactly, not guessed from the module stack: while
exporting, a forward pre-hook and a forward hook on every planned module that declares
inputs or outputs pass each tensor argument (by its forward-argument name) and each
tensor output through ``fxshard::module_boundary``, an identity custom op that
export records; afterwards those nodes become the ``region_input`` /
``region_output`` markers that ``fxshard.trace`` puts around modules it traces through.

The result is the graph form every pass expects: ``get_attr`` nodes with the model's
FQNs, ``nn_module_stack`` with real module classes, boundary markers, no runtime
asserts, the model's output structure.

Example::

    gm = capture(model, plan, example_kwargs={"input_ids": ids, "labels": labels})
    gm(input_ids=ids, labels=labels).logits
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim

from fxshard.markers import mark_arguments, mark_outputs, region_input, region_output
from fxshard.errors import PlanError
from fxshard.meta import program_meta
from fxshard.frontend.aten_ops import translate_aten
from fxshard.frontend.dtype_reads import CAST, restore_dtype_reads, watching_dtype_reads
from fxshard.frontend.opaque_regions import opaque_local_regions, restore_local_region_calls
from fxshard.frontend.hf_masks import causal_attention_as_sdpa_flag, causal_mask_hint
from fxshard.frontend.repeated_blocks import StampMismatch, fallback_note, only_captured_blocks, plan_stamping, stamp_blocks
from fxshard.state.module_state import add_missing_state, named_state


def mutates(node: fx.Node) -> bool:
    """Kept although unused: fx's own test, and in-place ``Tensor`` methods
    (``k[..., :2].copy_(x)`` writes into ``k`` and has no user)."""
    if node.is_impure():
        return True
    return node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("__")


@torch.library.custom_op("fxshard::module_boundary", mutates_args=())
def module_boundary(x: torch.Tensor, fqn: str, name: str, kind: str) -> torch.Tensor:
    """Identity marker recorded by export at a planned module's boundary (a custom op
    may not return its input, hence the clone; the node never survives capture)."""
    return x.clone()


@module_boundary.register_fake
def _(x, fqn, name, kind):
    return torch.empty_like(x)


def capture(model: nn.Module, plan=None, example_inputs: Sequence[Any] = (), example_kwargs: Mapping[str, Any] | None = None,
            dynamic_shapes=None, *, repeated_blocks: bool = True) -> fx.GraphModule:
    """Export ``model`` (non-strict) and normalize the graph into fxshard's form.

    ``dynamic_shapes`` defaults to every dim of integer inputs (token ids) and every
    dim but the last of float inputs being dynamic (``Dim.AUTO``: export keeps a dim
    static where the model needs it so).  ``repeated_blocks``: export only the first
    blocks of each kind and stamp the others (:mod:`fxshard.frontend.repeated_blocks`;
    ``ProgramMeta.capture_blocks`` says what was done).  The model is not modified.
    """
    stamp, why = plan_stamping(model) if repeated_blocks else (None, "repeated_blocks=False")
    # each input its own storage: export fakeifies a tensor once, so ``labels=ids`` (or a
    # view of another input, or a parameter passed as an input) would bind two names to one
    # placeholder and the program would read the wrong one when called with distinct tensors
    kwargs = own_storage(dict(example_kwargs or {}))
    args = own_storage(tuple(example_inputs))
    attempts = [(args, kwargs, dynamic_shapes)]
    default_dynamic = dynamic_shapes is None
    if dynamic_shapes is None:
        dynamic_shapes = _default_dynamic_shapes(model, args, kwargs)
        # export specializes dims of size 0 and 1 (a batch of one would be baked into
        # every view); capture on inputs grown to size 2 there (the shapes fxshard
        # records come from the real example inputs afterwards), and on the inputs as
        # given only if the model cannot run on the grown ones.
        grown = (_grow_unit_dims(args), {k: _grow_unit_dims(v) for k, v in kwargs.items()})
        attempts = [(*grown, dynamic_shapes), (args, kwargs, dynamic_shapes)]
    try:
        ep, region_calls = _export(model, plan, kwargs, attempts, stamp)
    except PlanError:
        raise
    except Exception as first:
        # a model that fills a cache on its first call (``if self.cache is None: self.cache = ...``)
        # builds it from fake tensors while exporting; once filled by a real call it is a constant
        warmed = _warm_up(model, args, kwargs)
        error = first
        if warmed is True:
            try:
                ep, region_calls = _export(model, plan, kwargs, attempts, stamp)
                error = None
            except PlanError:
                raise
            except Exception as again:
                error = again
        if error is not None:
            hint = causal_mask_hint(model, plan) + _cache_hint(model, warmed)
            raise PlanError(f"capturing {type(model).__name__} with torch.export (non-strict) failed: {type(error).__name__}: "
                            f"{_first_line(error)}{hint}\n  fix: make the model exportable (torch.export.export(model, args, "
                            f"kwargs, strict=False) must succeed), or pass a torch.fx-traceable model") from error
    gm = ep.module()
    if default_dynamic:
        program_meta(gm, create=True).static_input_dims = static = _static_input_dims(gm, args, kwargs)
        if static:
            warnings.warn(f"{type(model).__name__}: the model's code fixes "
                          + ", ".join(f"{name!r} dim {d} at {size}" for name, d, size in static)
                          + " (torch.export kept it static): the program runs at that size only, and says so when called "
                            "at another", stacklevel=2)
    restore_local_region_calls(gm, model, region_calls)
    _every_fqn(gm, model)
    _drop_guards(gm)
    _inline_blocks(gm)
    restore_dtype_reads(gm)
    _markers_from_boundaries(gm)
    translate_aten(gm)
    _devices_from_inputs(gm, model, args, kwargs)
    _module_stack_types(gm, model)
    if stamp is not None:
        try:
            stamp_blocks(gm, model, stamp)
        except StampMismatch as e:
            gm = capture(model, plan, example_inputs, example_kwargs, dynamic_shapes, repeated_blocks=False)
            program_meta(gm, create=True).capture_blocks = fallback_note(str(e), mismatch=True)
            return gm
    gm.graph.eliminate_dead_code(is_impure_node=mutates)  # in-place writes have no users
    gm.recompile()
    program = program_meta(gm, create=True)
    program.capture_blocks = stamp.describe() if stamp is not None else fallback_note(why, mismatch=False)
    program.captured_by = "torch.export"
    program.model_class = type(model).__name__
    return gm


def _export(model, plan, kwargs, attempts, stamp=None):
    """``torch.export.export`` (non-strict) of ``model`` with the planned boundaries
    marked, on each ``(args, kwargs, dynamic_shapes)`` of ``attempts`` until one works;
    returns the program and the opaque local regions' calls, or raises the last error."""
    with _boundary_hooks(model, plan), opaque_local_regions(model, plan) as region_calls, _training_config(model), \
            causal_attention_as_sdpa_flag(model, plan, kwargs), torch.fx.experimental._config.patch(use_duck_shape=False), \
            (only_captured_blocks(model, stamp) if stamp is not None else contextlib.nullcontext()), watching_dtype_reads():
        for i, (a, kw, dyn) in enumerate(attempts):
            try:
                return torch.export.export(model, a, kw, strict=False, dynamic_shapes=dyn), region_calls
            except PlanError:
                raise
            except Exception:
                if i + 1 == len(attempts):
                    raise


_CACHE_SETUPS = ("setup_caches", "setup_cache", "init_caches", "init_cache", "build_caches", "setup_kv_cache")


def _warm_up(model: nn.Module, args, kwargs):
    """Run ``model`` once eagerly on the example inputs, without gradients, as its first
    call would: a cache it fills then (a rotary table, a mask) is a real tensor when the
    model is exported again.  Returns True when the call changed an attribute of some
    module (so another export may succeed), False when it changed none, or the
    exception the call raised."""
    before = [(mod, dict(vars(mod))) for mod in model.modules()]
    try:
        with torch.no_grad(), _training_config(model):
            model(*args, **kwargs)
    except Exception as e:
        return e
    return any(vars(mod).get(k, _MISSING) is not v or len(vars(mod)) != len(attrs)
               for mod, attrs in before for k, v in attrs.items())


_MISSING = object()


def _cache_hint(model: nn.Module, warmed) -> str:
    """What to call when a warm-up could not help: a cache set-up method of the model."""
    setups = [f"model.{fqn + '.' if fqn else ''}{name}(...)" for fqn, mod in model.named_modules() for name in _CACHE_SETUPS
              if callable(getattr(mod, name, None))]
    tried = ("" if warmed is False else
             f"\n  (running the model once on the example inputs, to fill caches it builds on its first call, "
             f"{'did not help' if warmed is True else f'failed too: {type(warmed).__name__}: {_first_line(warmed)}'})")
    if setups:
        tried += (f"\n  the model sets up caches with {', '.join(sorted(set(setups))[:3])}: call it before fxshard.trace / "
                  f"fxshard.transform, so the caches are tensors of the model when it is captured")
    return tried


def own_storage(value):
    """``value`` (a pytree) with every tensor replaced by a copy on storage of its own
    (same shape, strides, dtype, device and ``requires_grad``; free on the meta device),
    so no two inputs, and no input and parameter, are one tensor to a tracer.

    Example::

        args, kwargs = own_storage((ids,)), own_storage({"input_ids": ids, "labels": ids})
        assert kwargs["labels"] is not kwargs["input_ids"]
    """
    from torch.utils._pytree import tree_map

    def own(t):
        if not isinstance(t, torch.Tensor):
            return t
        copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) if t.is_meta else t.detach().clone()
        return copy.requires_grad_(t.requires_grad) if t.requires_grad and (t.is_floating_point() or t.is_complex()) else copy

    return tree_map(own, value)


def _devices_from_inputs(gm: fx.GraphModule, model: nn.Module, args, kwargs) -> None:
    """Export bakes the devices it saw into the graph (``torch.arange(T, device=
    device(type='meta'))`` for a model captured on the meta device, HF's
    ``device=inputs_embeds.device``).  The program must run where its inputs are --
    after ``fxshard.materialize(..., device="cuda")`` or ``.to("cuda")`` -- so every
    capture-time device becomes ``input.device`` of the first tensor input."""
    from torch.utils._pytree import tree_leaves

    seen = {t.device for _, t in model.named_parameters()} | {t.device for _, t in model.named_buffers()}
    seen |= {t.device for t in tree_leaves((tuple(args), dict(kwargs or {}))) if isinstance(t, torch.Tensor)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first = next((n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)), None)
    users = [n for n in gm.graph.nodes if any(isinstance(a, torch.device) and a in seen
                                               for a in tree_leaves((n.args, n.kwargs)))]
    if first is None or not users:
        return
    with gm.graph.inserting_after(placeholders[-1]):
        device = gm.graph.create_node("call_function", getattr, (first, "device"), name="input_device")

    def swap(a):
        return device if isinstance(a, torch.device) and a in seen else a

    for n in users:
        n.args = fx.node.map_aggregate(n.args, swap)
        n.kwargs = fx.node.map_aggregate(n.kwargs, swap)


def flat_inputs(gm: fx.GraphModule, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> list[Any]:
    """The graph's placeholder values for a call ``gm(*args, **kwargs)``: a captured
    graph takes its inputs pytree-flattened by its ``in_spec``; a traced one by name."""
    return InputOrder.of(gm).flatten(args, kwargs)


@dataclass(frozen=True)
class InputOrder:
    """How a call's arguments map to a graph's placeholders, read from the graph once.  A
    forward pre-hook holds one (not the graph): ``torch.compile`` traces the hook, and
    dynamo does not trace into ``GraphModule.graph``."""

    in_spec: Any
    names: tuple[str, ...]

    @staticmethod
    def of(gm: fx.GraphModule) -> "InputOrder":
        info = getattr(gm.graph._codegen, "pytree_info", None)
        return InputOrder(info.in_spec if info is not None else None,
                          tuple(n.target for n in gm.graph.nodes if n.op == "placeholder"))

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> list[Any]:
        if self.in_spec is not None:
            import torch.fx._pytree as fx_pytree

            return list(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs or {})), self.in_spec))
        if not kwargs:
            return list(args)
        bound = dict(zip(self.names, args))
        unknown = sorted(set(kwargs) - set(self.names))
        if unknown:
            raise PlanError(f"example_kwargs {unknown} are not inputs of the graph (its inputs are {list(self.names)})")
        bound.update(kwargs)
        return [bound[n] for n in self.names if n in bound]


# ----------------------------------------------------------------------------- export set-up


def _dynamic_dims(x) -> range:
    """Batch and sequence: every dim of token ids, every dim but the features of floats."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return range(0)
    return range(x.dim() if not x.is_floating_point() else x.dim() - 1)


def _static_input_dims(gm: fx.GraphModule, args, kwargs) -> list[tuple[str, int, int]]:
    """``(placeholder, dim, size)`` of every input dim asked to be dynamic (``Dim.AUTO``)
    that export kept static because the model's code needs it so (a Python loop over the
    sequence, as Mamba's reference scan; a size compared with a constant): the program
    computes the example's size there and nothing else."""
    static = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, x in zip(placeholders, flat_inputs(gm, args, kwargs)):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d in _dynamic_dims(x):
            size = val.shape[d]
            # a specialized symbol still reads as a SymInt whose expression is now a number
            size = size if isinstance(size, int) else size.node.maybe_as_int()
            if size is not None:
                static.append((node.name, d, int(size)))
    return static


def _grow_unit_dims(value):
    from torch.utils._pytree import tree_map

    def grow(x):
        if not isinstance(x, torch.Tensor):
            return x
        for d in _dynamic_dims(x):
            if x.shape[d] == 1:
                x = x.expand(*x.shape[:d], 2, *x.shape[d + 1:]).contiguous()
        return x

    return tree_map(grow, value)


def _default_dynamic_shapes(model, args, kwargs):
    def dims(x):
        return {d: Dim.AUTO for d in _dynamic_dims(x)} or None

    sig = inspect.signature(model.forward)
    bound = sig.bind_partial(*args, **kwargs)
    out = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: dims(v) for k, v in value.items()}
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(dims(v) for v in value)
        else:
            out[name] = dims(value)
    return out


@contextlib.contextmanager
def _training_config(model):
    """HF models build a KV cache unless told not to, and a cache is no training
    output (nor a pytree export can return): switch ``use_cache`` off while capturing,
    in every config of the model (an encoder-decoder's decoder stack holds a copy of
    its own, T5 and BART build an ``EncoderDecoderCache`` from it)."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None):
            configs[id(config)] = config  # (by identity: one config object shared by many modules)
        for sub in (getattr(config, "decoder", None), getattr(config, "text_config", None)):
            if getattr(sub, "use_cache", None):
                configs[id(sub)] = sub
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


@contextlib.contextmanager
def _boundary_hooks(model: nn.Module, plan):
    handles = []
    try:
        if plan is not None:
            for fqn, module in model.named_modules():
                hit = plan.match(fqn)
                if hit is None:
                    continue
                pattern, spec = hit
                if spec.declares_boundary() and not spec.local:  # a local region's call is marked by normalize
                    handles.append(module.register_forward_pre_hook(_mark_inputs(fqn), with_kwargs=True))
                    handles.append(module.register_forward_hook(_mark_outputs(fqn, spec.out_names), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def _marker(fqn: str, kind: str):
    def one(value, name):
        return module_boundary(value, fqn, name, kind) if isinstance(value, torch.Tensor) else value
    return one


def _mark_inputs(fqn: str):
    def hook(module, args, kwargs):
        return mark_arguments(module, fqn, args, kwargs, _marker(fqn, "input"))
    return hook


def _mark_outputs(fqn: str, out_names):
    def hook(module, args, kwargs, out):
        return mark_outputs(out, fqn, out_names, _marker(fqn, "output"))
    return hook


# ----------------------------------------------------------------------------- normalization


def _every_fqn(gm: fx.GraphModule, model: nn.Module) -> None:
    """Export keeps a tied weight under one of its names only (GPT-2's ``wte.weight``
    lives on as ``lm_head.weight``): give the captured module every name the model has,
    bound to the same tensor, so plans and ``state_dict`` keys read as for the model."""
    have = {fqn: t for fqn, t, _ in named_state(gm)}
    by_id = {}
    for fqn, t, _ in named_state(model):
        if fqn in have:
            by_id.setdefault(id(t), have[fqn])
    add_missing_state(gm, [(fqn, by_id[id(t)], p) for fqn, t, p in named_state(model) if fqn not in have and id(t) in by_id])


def _drop_guards(gm: fx.GraphModule) -> None:
    """Export's input guards check the *global* shapes; a rank sees local ones."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")


def _inline_blocks(gm: fx.GraphModule) -> None:
    """Export records ``with torch.no_grad():`` and ``with torch.autocast(...):`` blocks
    as higher-order ops around submodules, opaque to layout rules.  Those that change
    nothing but gradients or nothing at all are inlined (:func:`_inline_no_grad_blocks`,
    :func:`_inline_inert_autocast_blocks`), innermost first: torchtitan's router asks
    for float32 autocast inside code that can end up in a no-grad block."""
    for child in gm.children():
        if isinstance(child, fx.GraphModule):
            _inline_blocks(child)
            child.recompile()
    _inline_inert_autocast_blocks(gm)
    _inline_no_grad_blocks(gm)
    used = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for name, child in list(gm.named_children()):
        # (not ``delete_all_unused_submodules``: it would also delete the bodies nested in a kept block)
        if isinstance(child, fx.GraphModule) and name not in used:
            delattr(gm, name)


def _inline_no_grad_blocks(gm: fx.GraphModule) -> None:
    """A ``with torch.no_grad():`` block (HF's rotary embeddings are one) inlined, with
    every output detached, computes the same values and passes no gradient, as before,
    and its ops get layouts like any other."""
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is hop and node.args[0] is False:
            _inline_block(gm, node, body=1, detach=True)


def _inline_inert_autocast_blocks(gm: fx.GraphModule) -> None:
    """An autocast block that casts nothing is its body: autocast disabled (as recorded:
    torchtitan's router asks for float32 on CPU, which autocast turns off), or every
    floating tensor in the block already of its dtype (a float32 model under float32
    autocast).  A block that casts is left whole: inlining it would drop the casts, so
    its op stays opaque and a sharded input to it is a PlanError."""
    hop = torch.ops.higher_order.wrap_with_autocast
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is hop and _casts_nothing(gm, node):
            _inline_block(gm, node, body=4, detach=False)


def _casts_nothing(gm: fx.GraphModule, node: fx.Node) -> bool:
    _device, dtype, enabled = node.args[:3]
    if not enabled:
        return True
    body = getattr(gm, node.args[4].target)
    vals = [n.meta.get("val") for n in body.graph.nodes] + [a.meta.get("val") for a in node.args[5:] if isinstance(a, fx.Node)]
    floats = [v for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return bool(floats) and all(v.dtype == dtype for v in floats)


def _inline_block(gm: fx.GraphModule, node: fx.Node, *, body: int, detach: bool) -> None:
    """Replace a higher-order op wrapping the submodule ``node.args[body]`` (called on
    the arguments after it) by that submodule's nodes.  ``detach``: tensor outputs
    leave detached (a no-grad block)."""
    graph = gm.graph
    sub = getattr(gm, node.args[body].target)
    if any(n.op in ("get_attr", "call_module") for n in sub.graph.nodes):
        return  # reads state of its own: leave it whole
    args = node.args[body + 1:]
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(node):
        outs = graph.graph_copy(sub.graph, dict(zip(placeholders, args)))
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        results = []
        inputs = [a for a in args if isinstance(a, fx.Node)]
        for o in outs:  # tensors leave detached; sizes (``min(k, x.shape[-1])``) as they are
            tensor = isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)
            same = _same_tensor_as(o, inputs) if detach else None
            if not (detach and tensor) or same is not None:
                # (a no-grad block handing an input back, ``x.to(x.dtype)`` is x: in eager it keeps its
                # gradient, and export routes later uses of x through here (Dots-3))
                results.append(same if same is not None else o)
                continue
            d = graph.call_method("detach", (o,))
            d.meta = {k: v for k, v in o.meta.items() if k in ("val", "nn_module_stack", "stack_trace")}
            results.append(d)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if not node.users:
        submod_attr = node.args[body]
        graph.erase_node(node)
        if not submod_attr.users:
            graph.erase_node(submod_attr)


def _same_tensor_as(out, inputs: list[fx.Node]) -> fx.Node | None:
    """The input that ``out`` *is*: the input itself, or a ``.to`` / ``.contiguous`` of it
    that changes nothing (eager returns ``self`` then), not a copy or a view."""
    aten = torch.ops.aten
    returns_self = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.contiguous.default, CAST)
    while isinstance(out, fx.Node) and out not in inputs:
        if not (out.op == "call_function" and out.target in returns_self and isinstance(out.args[0], fx.Node)):
            return None
        a, b = out.meta.get("val"), out.args[0].meta.get("val")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device
                and a.shape == b.shape and a.stride() == b.stride()):
            return None
        out = out.args[0]
    return out if isinstance(out, fx.Node) else None


def _markers_from_boundaries(gm: fx.GraphModule) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.fxshard.module_boundary.default:
            x, fqn, name, kind = node.args
            with graph.inserting_before(node):
                marker = graph.call_function(region_input if kind == "input" else region_output, (x, fqn, name))
            marker.meta = dict(node.meta)
            node.replace_all_uses_with(marker)
            graph.erase_node(node)


def _module_stack_types(gm: fx.GraphModule, model: nn.Module) -> None:
    """Export records ``nn_module_stack`` as ``{key: (fqn, "type name")}``; fxshard's
    passes read ``(fqn, type)``: resolve the types against the model."""
    types: dict[str, type] = {}

    def resolve(fqn: str):
        if fqn not in types:
            try:
                types[fqn] = type(model.get_submodule(fqn))
            except AttributeError:
                types[fqn] = None
        return types[fqn]

    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        clean = {}
        for key, (fqn, mtype) in stack.items():
            if key.startswith("_empty_nn_module_stack"):
                continue
            cls = resolve(fqn) if isinstance(mtype, str) else mtype
            clean[key] = (fqn, cls if cls is not None else mtype)
        node.meta["nn_module_stack"] = clean


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""
