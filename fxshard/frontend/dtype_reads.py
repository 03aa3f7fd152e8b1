"""Dtypes the model reads from tensors stay reads in a ``torch.export`` capture.

Export evaluates ``x.dtype`` while tracing and records the dtype it found.  HF's RMSNorm
(``input_dtype = hidden_states.dtype`` ... ``hidden_states.to(input_dtype)``) captured in
float32 then casts back to float32 whatever its input: under FSDP2's
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` the next linear meets a bfloat16
weight with a float32 input.  ``torch.fx.symbolic_trace`` keeps such a read as a node
(``getattr(x, "dtype")``); this module gives an export capture the same form.

While exporting, :func:`watching_dtype_reads` (a torch-function mode) follows the
model's own code, reading each call's source by its position:

- a ``T.dtype`` that the code assigns to a local (``input_dtype = hidden_states.dtype``,
  ``q_type, k_type = q.dtype, k.dtype``) is remembered for that call of the function;
- a cast ``x.to(D)`` (``x.to(dtype=D)``, ``x.to(device, D)``, ``x.type(D)``, ``x.to(T)``)
  whose ``D`` the source writes as ``<expr>.dtype`` (``cos.to(dtype=x.dtype)``; an HF
  model's ``self.dtype``: its parameters') or as such a local is recorded as
  ``fxshard::to(x, D, like=T)``, and so is the result of any other call passed such a
  ``dtype=`` (``F.softmax(x, dim, dtype=x.dtype)``, ``torch.zeros(n, dtype=h.dtype)``);
- a cast that changes nothing at capture (``hidden_states.to(torch.float32)`` of a
  float32 tensor, ``x.to(x.device)``) is recorded as ``fxshard::to(x, D)``: export would
  record it as ``x`` itself and send ``x``'s later uses through it, so the residual that
  HF's decoder layer adds after the norm would become the norm's float32 copy once ``x``
  is bfloat16 (and export writes ``x.to(device)`` with the dtype ``x`` had).

:func:`restore_dtype_reads` then writes them as torch code: ``x.to(dtype = T_dtype)``
after ``T_dtype = T.dtype`` (or the read as the other call's ``dtype``), and
``x.to(dtype = D)``.  A dtype the source writes as a literal
(``hidden_states.to(torch.float32)``, ``logits.float()``) is the model's choice and
stays, and so do the ones the mode cannot trace to a tensor: a dtype passed in as an
argument or read from a config, a value computed from it (``torch.finfo(dtype).min``),
a branch taken on it.  Every cast rewritten here is an identity in the capture's own
dtype, so a float32 program computes what it computed before, bit for bit.

Example::

    with watching_dtype_reads():
        ep = torch.export.export(model, args, kwargs, strict=False)
    gm = ep.module()
    restore_dtype_reads(gm)     # input_dtype's cast: mul_3.to(dtype = embedding_dtype)
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import inspect
import linecache
import os
import sys
from typing import Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode


@torch.library.custom_op("fxshard::to", mutates_args=())
def _to(x: torch.Tensor, dtype: Optional[torch.dtype], like: Optional[torch.Tensor] = None,
        device: Optional[torch.device] = None, argument: bool = False) -> torch.Tensor:
    """``x.to(device, dtype)``, recorded by export (the node never survives capture);
    ``like``: the tensor whose ``.dtype`` the model read; ``argument``: no cast of the
    model's, ``dtype`` was an argument of the op that made ``x``.  (A custom op may not
    return its input, hence the copy.)"""
    return x.to(device=device, dtype=dtype, copy=True)


@_to.register_fake
def _(x, dtype, like=None, device=None, argument=False):
    return torch.empty_like(x, dtype=dtype, device=device)


CAST = torch.ops.fxshard.to.default
_DTYPE = torch.Tensor.dtype.__get__
_FIXED = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64, torch.Tensor.half: torch.float16,
          torch.Tensor.bfloat16: torch.bfloat16}
_TORCH = os.path.dirname(torch.__file__) + os.sep
_NEAR = 32  # frames between the model's torch call and this mode: torch's modes, each calling a Python-level torch function again


@contextlib.contextmanager
def watching_dtype_reads() -> Iterator[None]:
    """Record the casts of the model's code that export runs inside the block as
    ``fxshard::to`` (see the module docstring)."""
    mode = _DtypeReads()
    try:
        with mode:
            yield
    finally:
        mode.stored.clear()  # the frames it pinned


def restore_dtype_reads(gm: fx.GraphModule) -> int:
    """Write every ``fxshard::to`` node of ``gm`` (and of its sub-GraphModules) as torch
    code, in place; returns how many read a tensor's dtype.

    ``fxshard::to(x, D)`` is ``x.to(dtype = D)``.  With ``like=T`` the dtype is read,
    ``T_dtype = T.dtype``: ``x.to(dtype = T_dtype)``, or, after an op that took the dtype
    as an argument (``F.softmax(x, dtype=x.dtype)``, ``torch.zeros(n, dtype=h.dtype)``),
    that op's argument.  A cast keeps its name and metadata."""
    reads = 0
    for child in gm.children():
        if isinstance(child, fx.GraphModule):
            reads += restore_dtype_reads(child)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not CAST:
            continue
        bound = dict(zip(("x", "dtype", "like", "device", "argument"), node.args))
        bound.update(node.kwargs)
        x, dtype, like, device = bound["x"], bound["dtype"], bound.get("like"), bound.get("device")
        if isinstance(like, fx.Node):
            with graph.inserting_before(node):
                read = graph.create_node("call_function", builtins.getattr, (like, "dtype"), name=f"{like.name}_dtype")
            read.meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
            read.meta["val"] = dtype
            reads += 1
            if bound.get("argument") and _read_into_producer(node, read):
                continue
            dtype = read
        node.op, node.target, node.args = "call_method", "to", (x,)
        node.kwargs = {k: v for k, v in (("dtype", dtype), ("device", device)) if v is not None}
    graph.lint()
    gm.recompile()
    return reads


def _read_into_producer(cast: fx.Node, read: fx.Node) -> bool:
    """``fxshard::to(op(..., dtype), D, like)`` recorded after an op that took ``D``: the
    read replaces the op's argument and the cast goes (False: not such an op)."""
    op = cast.args[0]
    if not isinstance(op, fx.Node) or op.op != "call_function" or len(op.users) != 1 or op.target is CAST:
        return False
    places = [("arg", i) for i, a in enumerate(op.args) if isinstance(a, torch.dtype)]
    places += [("kw", k) for k, a in op.kwargs.items() if isinstance(a, torch.dtype)]
    if len(places) != 1:
        return False
    kind, where = places[0]
    if kind == "arg":
        op.args = op.args[:where] + (read,) + op.args[where + 1:]
    else:
        op.kwargs = {**op.kwargs, where: read}
    op.prepend(read)  # the read comes before the op that uses it
    cast.replace_all_uses_with(op)
    cast.graph.erase_node(cast)
    return True


class _DtypeReads(TorchFunctionMode):
    """The torch-function mode of :func:`watching_dtype_reads`."""

    def __init__(self):
        super().__init__()
        # id(frame) -> (frame, {local: tensor whose dtype it holds}); the frame is kept so that its id is not reused
        self.stored: dict[int, tuple] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DTYPE:
            dtype = func(*args, **kwargs)
            if dtype.is_floating_point:
                self._remember(args[0])
            return dtype
        cast = _cast_of(func, args, kwargs)
        if cast is not None:
            x, dtype, like, device = cast
            if dtype is None:  # x.to(device): export would record x's dtype too, and x as the result
                return CAST(x, None, None, device) if x.is_floating_point() else func(*args, **kwargs)
            if like is None and func not in _FIXED:
                like = self._read_from(func, args, kwargs, dtype)
            if like is not None and like.dtype == dtype and (device is not None or like.device == x.device):
                return CAST(x, dtype, like, device)
            if device is None and x.dtype == dtype and dtype.is_floating_point:
                return CAST(x, dtype)
            return func(*args, **kwargs)
        # any other call given a dtype: F.softmax(x, dtype=...), torch.zeros(n, dtype=...), x.to(D, memory_format=...)
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            like = self._read_from(func, args, kwargs, dtype)
            out = func(*args, **kwargs)
            if like is not None and like.dtype == dtype and isinstance(out, torch.Tensor) and out.dtype == dtype:
                return CAST(out, dtype, like, argument=True)
            return out
        return func(*args, **kwargs)

    def _remember(self, tensor: torch.Tensor) -> None:
        """``name = tensor.dtype`` in the model's code: remember ``tensor`` for ``name``."""
        frame = _model_frame()
        name = _stored_into(frame) if frame is not None else None
        if name is not None:
            self.stored.setdefault(id(frame), (frame, {}))[1][name] = tensor

    def _read_from(self, func, args, kwargs, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor whose dtype the model's code passes as this call's ``dtype``, or None."""
        frame = _model_frame()
        expr = _dtype_argument(frame, func, args, kwargs, dtype) if frame is not None else None
        if isinstance(expr, ast.Attribute) and expr.attr == "dtype":
            owner = _evaluate(expr.value, frame)
            if isinstance(owner, torch.Tensor):
                return owner
            if isinstance(owner, nn.Module):  # an HF model's ``self.dtype``: its parameters'
                return next((p for p in owner.parameters() if p.dtype == dtype), None)
        if isinstance(expr, ast.Name) and frame.f_locals.get(expr.id) is dtype:
            return self.stored.get(id(frame), (None, {}))[1].get(expr.id)
        return None


def _cast_of(func, args, kwargs) -> tuple | None:
    """``(x, dtype, like, device)`` of a cast ``x.to(dtype)`` (or ``x.to(device, dtype)``,
    ``x.to(device)``: dtype None, ``x.type(dtype)``, ``x.float()``...; ``like``: the tensor
    of ``x.to(other)``), or None."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return None
    if func in _FIXED:
        return (x, _FIXED[func], None, None) if len(args) == 1 and not kwargs else None
    if func is not torch.Tensor.to and func is not torch.Tensor.type:
        return None
    rest = list(args[1:])
    if func is torch.Tensor.to and len(rest) == 1 and isinstance(rest[0], torch.Tensor) and not kwargs:
        return x, rest[0].dtype, rest[0], None
    device = kwargs.get("device")
    if func is torch.Tensor.to and rest and isinstance(rest[0], (torch.device, str)):
        device = rest.pop(0)
    dtype = rest.pop(0) if rest else kwargs.get("dtype")
    if rest or set(kwargs) - {"dtype", "device"}:
        return None
    if isinstance(dtype, torch.dtype) or dtype is None and isinstance(device, (torch.device, str)):
        return x, dtype, None, device
    return None


def _model_frame():
    """The frame of the code that made the torch call now handled: the first one outside
    this file and torch's within a few frames (torch's modes, a Python-level torch
    function such as ``F.softmax``); None for a call of torch's own machinery."""
    frame = sys._getframe(1)
    for _ in range(_NEAR):
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name != __file__:
            return frame
        frame = frame.f_back
    return None


_POSITIONS: dict = {}  # code object -> the source span of each instruction
_STORES: dict = {}     # code object -> {source span of ``<expr>.dtype``: the local it is assigned to}
_CALLS: dict = {}      # (code object, offset) -> the call expression there (ast.Call) or None


def _span(frame) -> tuple:
    """``(line, end_line, col, end_col)`` of the expression the instruction now running in
    ``frame`` evaluates (columns count UTF-8 bytes)."""
    code = frame.f_code
    if code not in _POSITIONS:  # (Python 3.10 has no positions: no dtype is traced to a tensor there)
        _POSITIONS[code] = list(code.co_positions()) if hasattr(code, "co_positions") else []
    positions = _POSITIONS[code]
    return positions[frame.f_lasti // 2] if frame.f_lasti // 2 < len(positions) else (None,) * 4


def _stored_into(frame) -> str | None:
    """The local that the ``.dtype`` read now running in ``frame`` is assigned to
    (``input_dtype = hidden_states.dtype``, ``q_type, k_type = q.dtype, k.dtype``), or None."""
    code = frame.f_code
    if code not in _STORES:
        _STORES[code] = _dtype_assignments(code)
    return _STORES[code].get(_span(frame))


def _dtype_assignments(code) -> dict[tuple, str]:
    """``{span of <expr>.dtype: name}`` for the assignments ``name = <expr>.dtype`` (and
    ``a, b = x.dtype, y.dtype``) in the source of ``code``'s function."""
    try:
        lines, first = inspect.getsourcelines(code)
    except (OSError, TypeError):
        return {}
    indent = lines[0][:len(lines[0]) - len(lines[0].lstrip())]
    try:  # parsed dedented; the columns are shifted back by the indent (ASCII whitespace)
        tree = ast.parse("".join(text[len(indent):] if text.startswith(indent) else text for text in lines))
    except SyntaxError:
        return {}
    found = {}
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, (ast.Tuple, ast.List)) and isinstance(node.value, (ast.Tuple, ast.List)) \
                        and len(target.elts) == len(node.value.elts):
                    pairs += zip(target.elts, node.value.elts)
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs.append((node.target, node.value))
        for target, value in pairs:
            if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and value.attr == "dtype":
                span = (value.lineno + first - 1, value.end_lineno + first - 1, value.col_offset + len(indent),
                        value.end_col_offset + len(indent))
                found[span] = target.id
    return found


def _dtype_argument(frame, func, args, kwargs, dtype: torch.dtype) -> ast.expr | None:
    """The source expression of the ``dtype`` the call now running in ``frame`` passes:
    the call (``x.to(...)``, ``F.softmax(...)``) read back from the source by its position."""
    key = (frame.f_code, frame.f_lasti)
    if key not in _CALLS:
        _CALLS[key] = _call_at(frame.f_code.co_filename, _span(frame))
    call = _CALLS[key]
    name = getattr(func, "__name__", None)
    called = call.func.attr if call is not None and isinstance(call.func, ast.Attribute) else \
        call.func.id if call is not None and isinstance(call.func, ast.Name) else None
    if called is None or called != name:
        return None
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    if kwargs.get("dtype") is dtype:
        return next((k.value for k in call.keywords if k.arg == "dtype"), None)
    # x.to(D) passes (x, D) to torch, F.softmax(x, d, D) as written (a method call spread over lines is
    # positioned at its attribute: ``to(D)``)
    offset = len(args) - len(call.args)
    positions = [i for i, a in enumerate(args) if a is dtype]
    if offset not in (0, 1) or len(positions) != 1 or positions[0] < offset:
        return None
    return call.args[positions[0] - offset]


def _call_at(filename: str, span: tuple) -> ast.Call | None:
    """The call expression at ``span`` of the source file, parsed (None without source)."""
    line, end_line, col, end_col = span
    lines = linecache.getlines(filename)
    if None in span or end_line > len(lines):
        return None
    chunk = [text.encode() for text in lines[line - 1:end_line]]  # the columns count UTF-8 bytes
    chunk[-1] = chunk[-1][:end_col]
    chunk[0] = chunk[0][col:]
    try:
        expr = ast.parse("(" + b"".join(chunk).decode() + ")", mode="eval").body
    except (SyntaxError, UnicodeDecodeError):
        return None
    return expr if isinstance(expr, ast.Call) else None


def _evaluate(expr: ast.expr, frame):
    """The value of a name or a chain of attributes (``x``, ``self.weight``) in ``frame``;
    None for any other expression (nothing is called)."""
    if isinstance(expr, ast.Attribute):
        owner = _evaluate(expr.value, frame)
        try:
            return getattr(owner, expr.attr, None) if owner is not None else None
        except Exception:  # a property that fails: the dtype stays as captured, the model's own call will say
            return None
    if isinstance(expr, ast.Name):
        for scope in (frame.f_locals, frame.f_globals, vars(builtins)):
            if expr.id in scope:
                return scope[expr.id]
    return None
