"""Input sizes the model's code fixed at capture, checked when the program is called.

fxshard captures batch and sequence dims as dynamic (``Dim.AUTO``), but torch.export keeps
a dim static where the model's code needs a number: a Python loop over the sequence
(Mamba's reference scan, used when its CUDA kernel is not installed, unrolls one step per
token), a size compared with a constant.  The program then computes that size and no
other; called on another, it would fail deep inside (or, for some code, compute on part of
the input).  ``frontend.capture`` records those dims (``ProgramMeta.static_input_dims``);
this module turns them into a check on the inputs of the transformed program (a forward
pre-hook; the pipeline's ``train_step`` checks its batch) that names the input, the dim
and the fix.

Example::

    sharded = fxshard.transform(jamba, plan, example_kwargs={"input_ids": ids_of_length_6})
    sharded(input_ids=ids_of_length_8)   # PlanError: input 'input_ids' dim 1 is fixed at 6 ...

The model's code may also fix a size *derived* from a dim that stays symbolic: DeepSeek-V4's
compressor pools the sequence in windows of 4, and at an example of 6 tokens export fixes
the number of windows at 1 (``Eq(s//4, 1)``), a range of 4 to 7 tokens for the input.
:func:`record_input_dim_ranges` records the ranges export narrowed so
(``ProgramMeta.input_dim_ranges``), with the fixed sizes that narrowed them, and the program
checks its inputs against them the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from fxshard.errors import PlanError
from fxshard.frontend.capture import InputOrder
from fxshard.meta import KEY, TensorInfo, program_meta


@dataclass(frozen=True)
class StaticSize:
    """Input ``name`` (placeholder ``index``) has ``local`` on ``dim`` on this rank: the
    model's code fixed the dim at ``size`` (global) when the program was captured."""

    index: int
    name: str
    dim: int
    local: int
    size: int


@dataclass(frozen=True)
class SizeRange:
    """Input ``name`` (placeholder ``index``) may have ``low`` to ``high`` (global; ``high``
    may be ``math.inf``) on ``dim``, and only lengths at which each size the model's code
    derives from the dim and export fixed is still the example's (``fixed``: ``(text,
    value)`` pairs, the text a Python expression of ``size``, ``(size//4) == 1``);
    ``bounds``: the model's own bounds on the dim, as text (see
    :func:`record_input_dim_ranges`).  ``ranks``: how many equal pieces this rank's input
    is one of (a sharded dim: the global length is ``ranks`` times the local one; 0 when the
    pieces may be unequal, then only an upper bound is checked)."""

    index: int
    name: str
    dim: int
    low: int
    high: float
    fixed: tuple
    bounds: str
    ranks: int = 1


def static_input_sizes(gm: fx.GraphModule) -> list[StaticSize | SizeRange]:
    """The fixed input dims of a transformed program, with this rank's local sizes, and the
    dims whose range the model's code narrowed (:class:`SizeRange`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: list[StaticSize | SizeRange] = []
    program = program_meta(gm)
    for name, dim, size in program.static_input_dims or []:
        index = next((i for i, n in enumerate(placeholders) if n.name == name), None)
        if index is None:  # an input cut away (a pipeline's loss target)
            continue
        value = getattr(placeholders[index].meta.get(KEY), "value", None)
        local = value.local_shape[dim] if isinstance(value, TensorInfo) else size
        out.append(StaticSize(index, name, dim, local, size))
    axes = program.mesh or {}
    for name, dim, low, high, fixed, bounds in program.input_dim_ranges or []:
        index = next((i for i, n in enumerate(placeholders) if n.name == name), None)
        if index is None:
            continue
        value = getattr(placeholders[index].meta.get(KEY), "value", None)
        ranks = math.prod(axes.get(a, 1) for a, p in (value.layout.items() if isinstance(value, TensorInfo) else ())
                          if getattr(p, "dim", None) is not None and p.dim % len(value.shape) == dim)
        even = ranks == 1 or (isinstance(value, TensorInfo) and isinstance(value.shape[dim], int)
                              and value.shape[dim] % ranks == 0)
        out.append(SizeRange(index, name, dim, low, high, tuple(fixed), bounds, ranks if even else 0))
    return out


def check_static_sizes(sizes: Sequence[StaticSize], inputs: dict, model: str, microbatches: int = 1) -> None:
    """Raise a PlanError when an input of ``inputs`` (by name) differs from its fixed size.
    ``microbatches``: the inputs are a whole batch that a schedule splits on dim 0."""
    for s in sizes:
        x = inputs.get(s.name)
        if not isinstance(x, torch.Tensor) or x.dim() <= s.dim:
            continue
        got = x.shape[s.dim] // microbatches if s.dim == 0 else x.shape[s.dim]
        if isinstance(s, SizeRange):
            _check_range(s, got, model, " per micro-batch" if s.dim == 0 and microbatches > 1 else "")
            continue
        if got != s.local:
            per = " per micro-batch" if s.dim == 0 and microbatches > 1 else ""
            here = f" ({s.local} on this rank)" if s.local != s.size else ""
            raise PlanError(
                f"input {s.name!r} of {model} has {got} on dim {s.dim}{per}, but the program was captured with that dim "
                f"fixed at {s.size}{here}: the model's code needs a number there (torch.export kept it static, e.g. a "
                f"Python loop over the sequence, as Mamba's reference scan without its CUDA kernel), so the program "
                f"computes that size only\n  fix: transform with example inputs of the size you run (one program per "
                f"size: pad the batches to one length and transform at it)")


def _check_range(s: SizeRange, got: int, model: str, per: str) -> None:
    """The global length is ``got`` times the pieces (equal pieces: the program assumes them,
    :func:`fxshard.training.batch.guard_equal_pieces` checks them before this); with unequal
    ones allowed (an example length the axis does not divide) nothing is checked here."""
    if s.ranks == 0:  # pieces that may be unequal: the global length is not known on this rank
        return
    length = got * s.ranks
    wrong = [(t, v) for t, v in s.fixed if _evaluated(t, length) not in (v, None)]
    if s.low <= length <= s.high and not wrong:
        return
    span = (f"{s.low} to {s.high}" if s.low else f"up to {s.high}") if s.high != math.inf else f"{s.low} or more"
    here = f" ({got} on this rank, one of {s.ranks} equal pieces)" if s.ranks > 1 else ""
    named = lambda t: t.replace("size", f"{s.name}.shape[{s.dim}]")  # noqa: E731
    if wrong:
        (text, value), got_value = wrong[0], _evaluated(wrong[0][0], length)
        narrowed = f" ({span})" if s.low or s.high != math.inf else ""
        raise PlanError(
            f"input {s.name!r} of {model} has {length} on dim {s.dim}{per}{here}, where {named(text)} is {got_value}, but "
            f"the program was captured with {named(text)} fixed at {value}, the example's: the model's code computes "
            f"that size from the dim and torch.export kept it a number while the dim itself stayed symbolic, so at this "
            f"length the program would compute with the example's size (a wrong shape, or a failure deep inside); it runs "
            f"only at lengths where {' and '.join(f'{named(t)} == {v}' for t, v in s.fixed)}{narrowed}\n  fix: transform "
            f"with example inputs of the size you run (one program per size: pad the batches to one length)")
    why = (f"the model's code fixes a size it computes from that dim ({', '.join(f'{named(t)} == {v}' for t, v in s.fixed)})"
           if s.fixed else f"the model's code bounds that dim ({s.bounds or 'a size compared with a constant'})")
    raise PlanError(f"input {s.name!r} of {model} has {length} on dim {s.dim}{per}{here}, but the program was captured for "
                    f"{span} there only: {why}\n  fix: keep dim {s.dim} within {span} (a limit of the model's own, as the "
                    f"rows of a position table), or transform with example inputs of the size you run")


_EVAL = {"__builtins__": {}, "Max": max, "Min": min, "Mod": lambda a, b: a % b, "PythonMod": lambda a, b: a % b,
         "FloorDiv": lambda a, b: a // b, "CeilDiv": lambda a, b: -(-a // b)}


def _evaluated(text: str, size: int):
    """``text`` (a Python expression of ``size``) at ``size``, or None where it does not
    evaluate (a function export prints that this does not know: then it is not checked)."""
    try:
        return int(eval(text, _EVAL, {"size": size}))  # noqa: S307 - export's own printed arithmetic, no builtins
    except Exception:  # noqa: BLE001
        return None


def record_input_dim_ranges(gm: fx.GraphModule) -> list[tuple[str, int, int, float, tuple, str]]:
    """``ProgramMeta.input_dim_ranges``: ``(placeholder, dim, low, high, fixed, bounds)`` of every
    symbolic input dim of an exported program whose range torch.export narrowed, or from
    which a size the model's code derives was fixed: ``fixed`` those sizes, ``(text, value)``
    with the text a Python expression of ``size`` (``("(size//4)", 1)``: export fixed the
    number of windows of 4 at the example's 1), ``bounds`` the model's own bounds on it
    (``0 <= 32 - tokens.shape[1]``: a table of 32 rows).  Read from the shape environment of the
    placeholders' fake tensors, before any shape is recorded again."""
    import sympy

    ranges = []
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
                continue
            symbol, env = size.node.expr, size.node.shape_env
            vr = env.var_to_range.get(symbol)
            if vr is None:
                continue
            low, high = _bound(vr.lower), _bound(vr.upper)
            low = max(int(low), 0) if low != -math.inf else 0
            size_symbol, named = sympy.Symbol("size"), sympy.Symbol(f"{node.name}.shape[{d}]")
            fixed, bounds = {}, []
            for guard in env.guards:
                e = guard.expr
                if e.free_symbols != {symbol} or not isinstance(e, sympy.core.relational.Relational):
                    continue
                if isinstance(e, sympy.Eq) and e.lhs != symbol and e.rhs.is_number:  # a derived size, fixed
                    fixed.setdefault(str(e.lhs.xreplace({symbol: size_symbol})), int(e.rhs))
                elif not isinstance(e, (sympy.Eq, sympy.Ne)):
                    bounds.append(str(e.xreplace({symbol: named})))
            if low <= 2 and high == math.inf and not fixed:  # export's default for a dynamic dim: nothing narrowed it
                continue
            low = 0 if low <= 2 else low  # export assumes 2 or more (it specializes 0 and 1): not the model's bound
            ranges.append((node.name, d, low, high, tuple(fixed.items()), ", ".join(dict.fromkeys(bounds))))
    program_meta(gm, create=True).input_dim_ranges = ranges
    return ranges


def _bound(b) -> float:
    """A bound of a sympy value range as a Python number (``math.inf`` for export's infinities)."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    if b in (int_oo, sympy.oo):
        return math.inf
    if b in (-int_oo, -sympy.oo):
        return -math.inf
    return int(b)


class StaticSizeGuard:
    """Forward pre-hook of a program with fixed input dims (:func:`guard_static_input_sizes`)."""

    def __init__(self, sizes: Sequence[StaticSize], model: str, order: InputOrder):
        self.sizes, self.model, self.order = tuple(sizes), model, order

    def __call__(self, module, args, kwargs):
        flat = self.order.flatten(args, kwargs)
        check_static_sizes(self.sizes, {s.name: flat[s.index] for s in self.sizes if s.index < len(flat)}, self.model)
        return None


def guard_static_input_sizes(gm: fx.GraphModule) -> list[StaticSize]:
    """Give ``gm`` a pre-hook that checks its fixed input dims, if it has any; returns them."""
    sizes = static_input_sizes(gm)
    if sizes:
        guard = StaticSizeGuard(sizes, program_meta(gm).model_class or type(gm).__name__, InputOrder.of(gm))
        gm.register_forward_pre_hook(guard, with_kwargs=True)
    return sizes
