"""Import a ``torch.distributed.tensor.parallel`` plan (``parallelize_module``'s
``{fqn_pattern: ParallelStyle}``) as an fxshard :class:`~fxshard.Plan`, field by field.

Every field of every style is either translated into the :class:`~fxshard.ModuleSpec`
(so the sharded program computes what ``parallelize_module`` with that plan computes)
or named in a :class:`~fxshard.PlanError` with the entry's pattern and a fix:

=================================================  ==============================================
torch style (fields)                               fxshard ``ModuleSpec``
=================================================  ==============================================
``ColwiseParallel(input_layouts, output_layouts)``  :func:`~fxshard.colwise` ``(inputs=, out=)``
``RowwiseParallel(input_layouts, output_layouts)``  :func:`~fxshard.rowwise` ``(inputs=, out=)``
``SequenceParallel(sequence_dim)``                  :func:`~fxshard.sequence_parallel` ``(dim=)``
``PrepareModuleInput(input_layouts,                 ``in_src`` (checked on entry) and ``inputs``
desired_input_layouts, input_kwarg_layouts,         (redistributed into), by position, by name,
desired_input_kwarg_layouts)``                      or both (``{0: ..., "mask": ...}``)
``PrepareModuleOutput(output_layouts,               ``out_src`` (checked) and ``out_dst``
desired_output_layouts)``                           (redistributed into), by position
``PrepareModuleInputOutput(...)``                   both of the above in one spec
torchtitan's ``NoParallel(input_layout,             ``inputs=Replicate``, ``in_src=input_layout``,
output_layout)``                                    ``out_dst=output_layout``, parameters replicated
=================================================  ==============================================

torch's ``loss_parallel()`` is a context manager, not a style: the head that keeps the
logits vocab-sharded (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``)
is what fxshard needs, and a cross-entropy in the model then runs on the shards.  torch's
experimental ``_ContextParallel`` is refused with :func:`fxshard.context_parallel` as the fix.

``None`` in a layout tuple is torch's "leave this argument / output alone"; it stays
``None`` (no declaration).  Keyword layouts apply only to the names ``input_kwarg_layouts``
lists, as in torch (a name only in ``desired_input_kwarg_layouts`` is left alone there).

``use_local_output`` / ``use_local_input`` (both values accepted, same spec): torch
returns a local shard (``True``) or a ``DTensor`` that carries its layout (``False``, the
default of ``SequenceParallel``, ``PrepareModuleInput`` and ``NoParallel``, and the
loss-parallel convention on an LM head).  fxshard's program has no DTensors: it carries
every value's layout through the graph, as a DTensor does, and runs the code after the
module on the shard that layout implies.  Both torch variants compute the same numbers
whenever the code after the module runs on them (a local shard only goes through
shard-agnostic code; a DTensor through DTensor's rules), and so does fxshard's program.

``src_data_rank`` (torch: the rank whose full weights ``distribute_tensor`` scatters;
``None``: every rank cuts its own copy): fxshard cuts each rank's shard from that
rank's full model, which :func:`fxshard.transform` requires to be the same on every
rank (a seeded init or a loaded checkpoint), so every value gives the same shards.

An :class:`fxshard.ModuleSpec` among the styles is taken as it is (the fix for a style
that cannot be translated, written in place).

Subclasses of these styles are translated through their base class only when they
change no behaviour: no method or class attribute of their own besides ``__init__``
and ``__repr__``, and no instance attribute the base class does not set (a subclass
that only fixes constructor arguments is fine).  Otherwise, as for any other
``ParallelStyle``, a PlanError names the subclass and what it adds; write an
:class:`fxshard.ModuleSpec` for that entry instead.

Example::

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = specs_from_torch(fxshard.MeshSpec(("tp",), (2,)), {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    plan.specs["w1"]          # ModuleSpec(style='colwise', ...)
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from torch.distributed.tensor import Placement, Replicate, Shard

from fxshard.errors import PlanError
from fxshard.plan.mesh import Mesh, mesh_shape
from fxshard.plan.specs import PlanEntries, ModuleSpec, colwise, rowwise, sequence_parallel

R = Replicate()

# Members a class may define without changing what the style does (construction,
# printing, Python's and abc's own bookkeeping).
_INERT_MEMBERS = frozenset({
    "__init__", "__repr__", "__str__", "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
    "__annotations__", "__annotate__", "__firstlineno__", "__static_attributes__", "__abstractmethods__",
    "_abc_impl", "__parameters__", "__orig_bases__", "__classcell__", "__slots__", "__type_params__",
})
# Instance attributes every ParallelStyle may carry (class attribute of the base).
_COMMON_FIELDS = frozenset({"src_data_rank"})


def specs_from_torch(mesh: Mesh, parallelize_plan: Mapping[str, Any], *, axis: str | None = None, inputs=None) -> PlanEntries:
    """``parallelize_module``'s plan ``{fqn_pattern: style instance}`` as an fxshard Plan
    on ``mesh``, the styles acting on ``axis`` (needed on a mesh of several axes).
    See the module docstring for the field-by-field translation.

    Example::

        plan = specs_from_torch(mesh, {"norm": SequenceParallel(),
                                      "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                                 desired_input_layouts=(Replicate(), None),
                                                                 input_kwarg_layouts={"mask": Shard(1)},
                                                                 desired_input_kwarg_layouts={"mask": Replicate()})})
        plan.specs["attn"].inputs      # {0: {'tp': Replicate()}, 'mask': {'tp': Replicate()}}
    """
    axes = mesh_shape(mesh)
    if axis is None:
        if len(axes) != 1:
            raise PlanError(f"Plan.from_torch: torch styles act on one mesh axis; pass axis= one of {list(axes)}")
        axis = next(iter(axes))
    elif axis not in axes:
        raise PlanError(f"Plan.from_torch(axis={axis!r}): not an axis of the mesh, whose axes are {list(axes)}")
    if not isinstance(parallelize_plan, Mapping):
        raise PlanError(f"Plan.from_torch: expected the plan as a dict {{fqn_pattern: ParallelStyle}} of submodules, got "
                        f"{type(parallelize_plan).__name__}; fxshard plans name submodules (a style for the whole model "
                        f"has no entry): give the style to the submodules it is meant for, e.g. {{'w1': ColwiseParallel()}}")
    specs = {pattern: style_to_spec(style, axis, pattern) for pattern, style in parallelize_plan.items()}
    return PlanEntries(specs, inputs)


def style_to_spec(style: Any, axis: str, pattern: str = "?") -> ModuleSpec:
    """One torch ``ParallelStyle`` instance as the :class:`~fxshard.ModuleSpec` that does
    the same on mesh axis ``axis`` (PlanError naming ``pattern`` if it cannot).

    Example: ``style_to_spec(ColwiseParallel(output_layouts=Replicate()), "tp")`` is
    ``colwise("tp", out=Replicate())``.
    """
    return _convert(style, axis, f"Plan.from_torch entry {pattern!r}")


def _convert(style: Any, axis: str, where: str) -> ModuleSpec:
    if isinstance(style, ModuleSpec):  # the fix the errors below suggest, written into the torch plan
        return style
    if isinstance(style, type):
        raise PlanError(f"{where}: got the class {style.__name__}; write an instance, {style.__name__}()")
    known = _known_styles()
    base = next((c for c in type(style).__mro__ if c in known), None)
    if getattr(style, "__name__", None) == "loss_parallel":
        raise PlanError(f"{where}: loss_parallel is torch's context manager for the loss, not a style of a module; "
                        f"keep the logits vocab-sharded instead (ColwiseParallel(output_layouts=Shard(-1), "
                        f"use_local_output=False) on the LM head): fxshard then computes a cross-entropy in the model "
                        f"on the shards, as loss_parallel() does")
    if type(style).__name__ == "_ContextParallel":  # torch's experimental context parallelism of an attention module
        raise PlanError(f"{where}: torch's _ContextParallel (seq_dim={getattr(style, 'seq_dim', '?')}) has no one-to-one "
                        f"fxshard spec: write fxshard.context_parallel('cp', method='allgather' or 'ring') on the module "
                        f"around the attention, and shard the token inputs over 'cp' with Plan(inputs=...)")
    if base is None:
        raise PlanError(f"{where}: no conversion for {_qualname(type(style))}, which is not one of torch's styles "
                        f"({', '.join(c.__name__ for c in known)}) nor a subclass of one; write an fxshard.ModuleSpec "
                        f"for it (see fxshard.colwise / rowwise / sequence_parallel / ModuleSpec(inputs=, out_dst=))")
    fields, convert = known[base]
    if type(style) is not base:
        _check_inert_subclass(style, base, fields, where)
    missing = [f for f in fields if not hasattr(style, f) and not f.startswith("?")]
    if missing:
        raise PlanError(f"{where}: {_qualname(type(style))} has no attribute(s) {missing} that {base.__name__} sets in "
                        f"__init__ (does its __init__ call super().__init__?); call it, or write an fxshard.ModuleSpec")
    return convert(style, axis, where)


# ----------------------------------------------------------------------------- subclasses


def _check_inert_subclass(style, base: type, fields: tuple[str, ...], where: str) -> None:
    """A subclass is read as its base only if it changes no behaviour."""
    name = _qualname(type(style))
    allowed = {f.lstrip("?") for f in fields} | _COMMON_FIELDS
    for cls in type(style).__mro__:
        if cls is base:
            break
        for member in vars(cls):
            if member in _INERT_MEMBERS or member in allowed:
                continue
            what = "overrides" if hasattr(base, member) else "adds"
            raise PlanError(f"{where}: {name} (a subclass of {base.__name__}) {what} {member!r}, so "
                            f"parallelize_module would not do what {base.__name__} does and fxshard cannot read it as one; "
                            f"write the entry as an fxshard.ModuleSpec that does what {name} does "
                            f"(params=, inputs=, in_src=, out_src=, out_dst=)")
    extra = sorted(set(vars(style)) - allowed)
    if extra:
        raise PlanError(f"{where}: {name} (a subclass of {base.__name__}) sets attribute(s) {extra} that "
                        f"{base.__name__} does not have, so fxshard cannot tell what they do; write the entry as an "
                        f"fxshard.ModuleSpec that does what {name} does (params=, inputs=, in_src=, out_src=, out_dst=)")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ----------------------------------------------------------------------------- styles


def _known_styles() -> dict[type, tuple[tuple[str, ...], Callable]]:
    """``{style class: (its instance fields, converter)}``; a field with a leading ``?``
    is set only after the style was applied once (RowwiseParallel's, in ``_apply``)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel, SequenceParallel)

    known = {
        ColwiseParallel: (("input_layouts", "output_layouts", "desired_input_layouts", "use_local_output"), _colwise),
        RowwiseParallel: (("input_layouts", "output_layouts", "use_local_output", "?desired_input_layouts"), _rowwise),
        SequenceParallel: (("sequence_sharding", "use_local_output"), _sequence_parallel),
        PrepareModuleInput: (("input_layouts", "desired_input_layouts", "input_kwarg_layouts", "desired_input_kwarg_layouts",
                              "with_kwargs", "use_local_output"), _prepare_input),
        PrepareModuleOutput: (("output_layouts", "desired_output_layouts", "use_local_output"), _prepare_output),
        PrepareModuleInputOutput: (("prepare_module_input", "prepare_module_output"), _prepare_input_output),
    }
    try:  # torchtitan is optional
        from torchtitan.distributed.tensor_parallel import NoParallel
    except Exception:  # noqa: BLE001 - any import failure means: not installed here
        NoParallel = None
    if NoParallel is not None:
        known[NoParallel] = (("input_layout", "output_layout", "desired_input_layout", "use_local_output"), _no_parallel)
    return known


def _one(layouts, what: str, where: str) -> Placement:
    """The single placement of a 1-D style's layout tuple."""
    if isinstance(layouts, Placement):
        return layouts
    if not isinstance(layouts, (tuple, list)) or len(layouts) != 1 or not isinstance(layouts[0], Placement):
        raise PlanError(f"{where}: {what}={layouts!r}; torch applies it to a 1-D mesh, so it must hold one placement "
                        f"(Shard(d), Replicate() or Partial()); fix it, or write an fxshard.ModuleSpec")
    return layouts[0]


def _colwise(style, axis: str, where: str) -> ModuleSpec:
    desired = _one(style.desired_input_layouts, "desired_input_layouts", where)
    if desired != R:
        raise PlanError(f"{where}: ColwiseParallel with desired_input_layouts=({desired!r},): a column-parallel linear "
                        f"computes on a replicated input (torch sets Replicate()); drop the change, or write an "
                        f"fxshard.ModuleSpec for the layout you want")
    return colwise(axis, inputs=_one(style.input_layouts, "input_layouts", where),
                   out=_one(style.output_layouts, "output_layouts", where))


def _rowwise(style, axis: str, where: str) -> ModuleSpec:
    # desired_input_layouts (if already applied once) follows the module type, as fxshard's
    # rowwise does: Shard(-1) on a Linear, Replicate() (vocab-parallel) on an Embedding
    return rowwise(axis, inputs=_one(style.input_layouts, "input_layouts", where),
                   out=_one(style.output_layouts, "output_layouts", where))


def _sequence_parallel(style, axis: str, where: str) -> ModuleSpec:
    seq = _one(style.sequence_sharding, "sequence_sharding", where)
    if not isinstance(seq, Shard):
        raise PlanError(f"{where}: SequenceParallel with sequence_sharding=({seq!r},): it must be Shard(sequence_dim); "
                        f"fix it, or write an fxshard.ModuleSpec")
    return sequence_parallel(axis, dim=seq.dim)


def _layout(p, axis: str, what: str, where: str):
    if p is None:
        return None
    if not isinstance(p, Placement):
        raise PlanError(f"{where}: {what} holds {p!r}, not a Placement (Shard(d), Replicate(), Partial()) or None; fix it")
    return {axis: p}


def _as_tuple(v):
    return (v,) if isinstance(v, Placement) else v


def _input_fields(style, axis: str, where: str) -> tuple[Any, Any]:
    """``(inputs, in_src)`` of a PrepareModuleInput: a tuple by position, a dict by name,
    or a dict of both (positions as int keys) when it mixes them."""
    positional_src = _as_tuple(style.input_layouts)
    positional_dst = _as_tuple(style.desired_input_layouts)
    by_position_dst: dict[Any, Any] = {}
    by_position_src: dict[Any, Any] = {}
    if positional_src is not None:
        if positional_dst is None or len(positional_dst) != len(positional_src):
            raise PlanError(f"{where}: PrepareModuleInput with input_layouts={positional_src!r} and desired_input_layouts="
                            f"{positional_dst!r}: give one desired layout (or None) per input layout, as torch requires")
        for i, (src, dst) in enumerate(zip(positional_src, positional_dst)):
            s = _layout(src, axis, f"input_layouts[{i}]", where)
            # torch leaves an argument whose input layout is None alone, whatever its desired layout
            d = _layout(dst, axis, f"desired_input_layouts[{i}]", where) if s is not None else None
            by_position_src[i], by_position_dst[i] = s, d
    by_name_src: dict[str, Any] = {}
    by_name_dst: dict[str, Any] = {}
    if style.with_kwargs:
        for name, src in (style.input_kwarg_layouts or {}).items():
            s = _layout(src, axis, f"input_kwarg_layouts[{name!r}]", where)
            dst = (style.desired_input_kwarg_layouts or {}).get(name)
            by_name_src[name] = s
            by_name_dst[name] = _layout(dst, axis, f"desired_input_kwarg_layouts[{name!r}]", where) if s is not None else None
    if not by_name_src:  # by position only (or nothing)
        if not by_position_src:
            return None, None
        n = len(by_position_src)
        return tuple(by_position_dst[i] for i in range(n)), tuple(by_position_src[i] for i in range(n))
    if not by_position_src:
        return by_name_dst, by_name_src
    return {**by_position_dst, **by_name_dst}, {**by_position_src, **by_name_src}


def _output_fields(style, axis: str, where: str) -> tuple[Any, Any]:
    """``(out_src, out_dst)`` of a PrepareModuleOutput, by position (one output: a layout)."""
    src = _as_tuple(style.output_layouts)
    dst = _as_tuple(style.desired_output_layouts)
    if src is None or dst is None or len(src) != len(dst):
        raise PlanError(f"{where}: PrepareModuleOutput with output_layouts={src!r} and desired_output_layouts={dst!r}: "
                        f"give one desired layout per output layout, as torch requires")
    outs, dsts = [], []
    for i, (s, d) in enumerate(zip(src, dst)):
        s = _layout(s, axis, f"output_layouts[{i}]", where)
        if s is not None and d is None:
            raise PlanError(f"{where}: desired_output_layouts[{i}] is None for output layout {src[i]!r}; torch would "
                            f"fail redistributing into None: give the layout the output must have")
        outs.append(s)
        dsts.append(_layout(d, axis, f"desired_output_layouts[{i}]", where) if s is not None else None)
    if len(outs) == 1:
        return outs[0], dsts[0]
    return tuple(outs), tuple(dsts)


def _prepare_input(style, axis: str, where: str) -> ModuleSpec:
    inputs, in_src = _input_fields(style, axis, where)
    return ModuleSpec(inputs=inputs, in_src=in_src, style="prepare_input")


def _prepare_output(style, axis: str, where: str) -> ModuleSpec:
    out_src, out_dst = _output_fields(style, axis, where)
    return ModuleSpec(out_src=out_src, out_dst=out_dst, style="prepare_output")


def _prepare_input_output(style, axis: str, where: str) -> ModuleSpec:
    # the two halves torch builds; read (and checked) as the styles they are
    inp = _convert(style.prepare_module_input, axis, f"{where} (its prepare_module_input)")
    out = _convert(style.prepare_module_output, axis, f"{where} (its prepare_module_output)")
    if inp.style != "prepare_input" or out.style != "prepare_output":
        raise PlanError(f"{where}: its prepare_module_input / prepare_module_output are not a PrepareModuleInput and a "
                        f"PrepareModuleOutput; build it with PrepareModuleInputOutput(...), or write an fxshard.ModuleSpec")
    return ModuleSpec(inputs=inp.inputs, in_src=inp.in_src, out_src=out.out_src, out_dst=out.out_dst, style="prepare_input_output")


def _no_parallel(style, axis: str, where: str) -> ModuleSpec:
    """torchtitan's NoParallel: parameters replicated, the first input redistributed
    from ``input_layout`` to Replicate, the output redistributed to ``output_layout``."""
    src = _one(style.input_layout, "input_layout", where)
    desired = _one(style.desired_input_layout, "desired_input_layout", where)
    out = _one(style.output_layout, "output_layout", where)
    return ModuleSpec(inputs={axis: desired}, in_src={axis: src}, out_dst={axis: out}, style="no_parallel")
