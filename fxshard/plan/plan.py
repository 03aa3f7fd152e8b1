"""Sharding plans as plain data: which module's tensors live where on the mesh.

Example::

    >>> from torch.distributed.tensor import Shard, Replicate
    >>> plan = Plan(MeshSpec(("tp",), (2,)), {
    ...     "layers.*.attention.wq": colwise(),
    ...     "layers.*.attention.wo": rowwise(),
    ... })
    >>> plan.specs["layers.*.attention.wq"].params
    {'weight': {'tp': Shard(dim=0)}, 'bias': {'tp': Shard(dim=0)}}
"""
from __future__ import annotations

import difflib
from typing import Any, Mapping

from torch.distributed.tensor import Placement

from fxshard.errors import PlanError
from fxshard.layout.placements import complete, fmt_layout
from fxshard.plan.mesh import Mesh, mesh_shape
from fxshard.plan.specs import CP_METHODS, ContextParallel, LayoutLike, ModuleSpec, fmt_entry_value, pattern_regex

class Plan:
    """A sharding plan: a mesh, ``{fqn_pattern: ModuleSpec}`` and the layouts of the
    graph inputs by placeholder name (default: all ``Replicate``).

    Example::

        plan = fxshard.Plan(mesh, {
            "layers.*.attention.wq": fxshard.colwise(),
            "layers.*.attention.wo": fxshard.rowwise(),
        }, inputs={"tokens": {"dp": Shard(0)}})

    ``fsdp="dp"`` gives that axis to FSDP2 (:func:`fxshard.fully_shard`): fxshard adds
    no gradient sync on it, its gradients follow FSDP2's convention (the mean over the
    axis of each rank's gradient, so a per-rank mean loss trains on the global mean),
    and the transformed module calls one submodule per transformer block.
    ``fsdp=("dp", "cp")``: several axes, the parameters sharded over their product
    (torchtitan's ``dp_shard_cp``); a context-parallel axis among them keeps fxshard's
    convention (its ranks' gradients are summed), FSDP2 takes over only the syncs.

    ``pipeline=fxshard.pipeline("pp", microbatches=M, ...)``: pipeline parallelism over a mesh
    axis that is not the plan's (its mesh is the sub-mesh of the other axes); run it with
    :func:`fxshard.pipeline_transform` (docs/pipeline.md).

    Validated on construction against the mesh (unknown axes, malformed layouts);
    patterns, parameter names and divisibility are checked against the model by
    ``fxshard.transform``.
    """

    def __init__(self, mesh: Mesh, specs: Mapping[str, ModuleSpec] | None = None, inputs: Mapping[str, LayoutLike] | None = None,
                 *, fsdp: str | tuple[str, ...] | None = None, pipeline=None):
        self.mesh = mesh
        self.axes = mesh_shape(mesh)
        if pipeline is not None:
            from fxshard.plan.pipeline import check_plan_pipeline

            check_plan_pipeline(pipeline, self.axes)
        self.pipeline = pipeline
        if isinstance(fsdp, (list, tuple)) and len(fsdp) == 1:
            fsdp = fsdp[0]
        self.fsdp_axes: tuple[str, ...] = (fsdp,) if isinstance(fsdp, str) else tuple(fsdp or ())
        for axis in self.fsdp_axes:
            if axis not in self.axes:
                raise PlanError(f"Plan(fsdp={fsdp!r}): {axis!r} is not an axis of the mesh, whose axes are {list(self.axes)}; "
                                f"name the data-parallel axis (or axes) that FSDP2 shards over")
        self.fsdp = tuple(fsdp) if isinstance(fsdp, list) else fsdp
        self.specs: dict[str, ModuleSpec] = dict(specs or {})
        self.inputs: dict[str, dict] = {}
        for name, layout in (inputs or {}).items():
            self.inputs[name] = complete(layout, self.axes, f"Plan inputs[{name!r}]")
        for pattern, spec in self.specs.items():
            if not isinstance(spec, ModuleSpec):
                raise PlanError(
                    f"plan entry {pattern!r}: expected an fxshard.ModuleSpec (colwise(), rowwise(), ...), got "
                    f"{type(spec).__name__}; for torch.distributed.tensor.parallel styles use Plan.from_torch(mesh, plan)"
                )
            self._check_spec(pattern, spec)
        self._regex = {p: pattern_regex(p) for p in self.specs}
        self.context_parallel_axes()  # one load_balance per axis

    def context_parallel_axes(self) -> dict[str, ContextParallel]:
        """``{axis: ContextParallel}`` of the axes the plan's attention is context-parallel
        on.  Every entry of one axis must agree on ``load_balance`` (it fixes which
        positions each rank holds, for the whole sequence)."""
        out: dict[str, ContextParallel] = {}
        for pattern, spec in self.specs.items():
            cp = spec.context_parallel
            if cp is None:
                continue
            if cp.axis in out and out[cp.axis].load_balance != cp.load_balance:
                raise PlanError(f"plan entry {pattern!r}: context_parallel(load_balance={cp.load_balance}) on {cp.axis!r}, but "
                                f"another entry says load_balance={out[cp.axis].load_balance}; the sequence has one layout per "
                                f"axis: give every context_parallel entry of {cp.axis!r} the same load_balance")
            out.setdefault(cp.axis, cp)
        return out

    def _check_spec(self, pattern: str, spec: ModuleSpec) -> None:
        if spec.distributed_norm is not None and spec.distributed_norm not in self.axes:
            raise PlanError(f"plan entry {pattern!r}: distributed_norm axis {spec.distributed_norm!r} is not an axis of the mesh, "
                            f"whose axes are {list(self.axes)}; name the axis the normalized dim is sharded on")
        cp = spec.context_parallel
        if cp is not None:
            if cp.axis not in self.axes:
                raise PlanError(f"plan entry {pattern!r}: context_parallel axis {cp.axis!r} is not an axis of the mesh, whose axes "
                                f"are {list(self.axes)}; name the axis the sequence is sharded on")
            if cp.method not in CP_METHODS:
                raise PlanError(f"plan entry {pattern!r}: context_parallel method {cp.method!r}; use one of {list(CP_METHODS)}")
        for name, layout in spec.params.items():
            complete(layout, self.axes, f"plan entry {pattern!r} params[{name!r}]")
        for field_name in ("inputs", "in_src", "out_src", "out_dst"):
            v = getattr(spec, field_name)
            if v is None:
                continue
            if isinstance(v, Mapping) and any(k in self.axes for k in v) and not is_layout(v, self.axes):
                raise PlanError(f"plan entry {pattern!r} {field_name}={fmt_entry_value(v)} mixes mesh axes and argument/output names; "
                                f"write one layout {{axis: Placement}}, or layouts by name {{name: {{axis: Placement}}}}")
            items = v.items() if isinstance(v, Mapping) and not is_layout(v, self.axes) else (
                enumerate(v) if isinstance(v, (tuple, list)) else [(None, v)])
            for key, layout in items:
                if layout is not None:
                    where = f"plan entry {pattern!r} {field_name}" + (f"[{key!r}]" if key is not None else "")
                    complete(layout, self.axes, where)

    # -- matching ---------------------------------------------------------------------
    def match(self, fqn: str) -> tuple[str, ModuleSpec] | None:
        """The (pattern, spec) that applies to module ``fqn``; PlanError if two differ."""
        hits = [(p, s) for p, s in self.specs.items() if self._regex[p].match(fqn)]
        if len(hits) > 1 and any(s != hits[0][1] for _, s in hits[1:]):
            raise PlanError(
                f"module {fqn!r} is matched by several plan entries with different specs: "
                f"{[p for p, _ in hits]}; make the patterns disjoint"
            )
        return hits[0] if hits else None

    def check_patterns(self, fqns: list[str]) -> None:
        """Every pattern must match at least one module; suggest the closest FQN."""
        for pattern, rx in self._regex.items():
            if not any(rx.match(f) for f in fqns):
                close = difflib.get_close_matches(pattern.replace("*", "0"), fqns, n=3, cutoff=0.3)
                hint = f"; closest module FQNs: {close}" if close else ""
                raise PlanError(f"plan entry {pattern!r} matches no module of the model{hint}. Fix the pattern (FQNs use '.' and '*' matches one name)")

    # -- data-like behaviour -------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return (isinstance(other, Plan) and self.axes == other.axes and self.specs == other.specs and self.inputs == other.inputs
                and self.fsdp == other.fsdp and self.pipeline == other.pipeline)

    def replace(self, *, specs: Mapping[str, ModuleSpec] | None = None, inputs: Mapping[str, LayoutLike] | None = None,
                fsdp: str | tuple[str, ...] | None = None, pipeline=None) -> "Plan":
        """A copy with the given fields replaced (the others kept).

        Example: ``Plan.from_hf(mesh, model).replace(inputs={"input_ids": {"dp": Shard(0)}}, fsdp="dp")``
        """
        return type(self)(self.mesh, self.specs if specs is None else specs, self.inputs if inputs is None else inputs,
                          fsdp=self.fsdp if fsdp is None else fsdp, pipeline=self.pipeline if pipeline is None else pipeline)

    def __repr__(self) -> str:
        mesh = ", ".join(f"{a}={n}" for a, n in self.axes.items())
        lines = [f"Plan(mesh({mesh}), {{"]
        lines += [f"    {p!r}: {s!r}," for p, s in self.specs.items()]
        lines.append("}" + (f", inputs={{{', '.join(f'{k!r}: {fmt_layout(v)}' for k, v in self.inputs.items())}}}" if self.inputs else "")
                     + (f", fsdp={self.fsdp!r}" if self.fsdp else "") + (f", pipeline={self.pipeline!r}" if self.pipeline else "")
                     + ")")
        return "\n".join(lines)

    # -- conversion from transformers' plans ------------------------------------------------
    @classmethod
    def from_hf(cls, mesh: Mesh, model, *, axis: str = "tp", ep_axis: str = "ep", sequence_parallel: bool = False,
                loss_parallel: bool = False) -> "Plan":
        """The parallel plans a transformers model ships, as an fxshard Plan.

        Reads ``config.base_model_tp_plan`` and the head's ``_tp_plan`` (HF's style
        strings, ``"colwise"``, ``"rowwise"``, ...; see :mod:`fxshard.plan.importers.hf_plan`
        for the mapping) when the mesh has ``axis``, and ``config.base_model_ep_plan``
        (the routed experts split over the experts) when it has ``ep_axis``; entries for
        modules this model lacks are dropped, a tied LM head and embedding get one
        layout.  GPT-2, for which HF ships no plan, gets fxshard's.
        ``sequence_parallel``: Megatron-style sequence-sharded residual stream;
        ``loss_parallel``: vocab-sharded logits.  Unknown styles raise ``PlanError``.

        Example::

            model = transformers.LlamaForCausalLM(config)
            plan = fxshard.Plan.from_hf(mesh, model, sequence_parallel=True)
            print(plan)   # 'model.layers.*.self_attn.q_proj': ModuleSpec(style='colwise', ...)
            plan = fxshard.Plan.from_hf(ep_tp_mesh, mixtral)   # experts: routed_experts(ep='ep', tp='tp')
        """
        from fxshard.plan.importers.hf_plan import specs_from_hf  # duck-typed on the model: transformers is never imported

        entries = specs_from_hf(mesh, model, axis=axis, ep_axis=ep_axis, sequence_parallel=sequence_parallel,
                            loss_parallel=loss_parallel)
        return cls(mesh, entries.specs, inputs=entries.inputs)

    # -- conversion from torch.distributed.tensor.parallel ---------------------------------
    @classmethod
    def from_torch(cls, mesh: Mesh, parallelize_plan: Mapping[str, Any], *, axis: str | None = None, inputs=None) -> "Plan":
        """Convert a ``parallelize_module`` plan (style *instances*) into an fxshard Plan.

        Every field of every style is translated or refused with a PlanError that names
        the entry and the fix (see :mod:`fxshard.plan.importers.torch_plan` for the table):
        ``ColwiseParallel``/``RowwiseParallel`` keep their ``input_layouts`` and
        ``output_layouts``; ``SequenceParallel`` becomes :func:`sequence_parallel`;
        ``PrepareModuleInput``/``PrepareModuleOutput``/``PrepareModuleInputOutput``
        redistribute inputs (by position, by keyword or both) and outputs; torchtitan's
        ``NoParallel`` replicates.  ``use_local_output`` may take either value.  A
        subclass is read as its base only if it changes no behaviour; otherwise the
        error names it and what it overrides or adds.  An ``fxshard.ModuleSpec`` among
        the styles is taken as it is.

        Example::

            Plan.from_torch(mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        """
        from fxshard.plan.importers.torch_plan import specs_from_torch

        entries = specs_from_torch(mesh, parallelize_plan, axis=axis, inputs=inputs)
        return cls(mesh, entries.specs, inputs=entries.inputs)

    @classmethod
    def from_torchtitan(cls, mesh: Mesh, model, **kw) -> "Plan":
        """torchtitan's own tensor/sequence-parallel plan for ``model`` (a torchtitan
        decoder such as ``Llama3Model``, built from its config), converted.

        Keywords (see :func:`fxshard.plan.importers.torchtitan_plan.specs_from_torchtitan`):
        ``axis="tp"``, ``loss_parallel=False``, ``sequence_parallel=True``, ``inputs``.

        Example::

            plan = Plan.from_torchtitan(MeshSpec(("tp",), (2,)), model, loss_parallel=True)
            plan.specs["lm_head"].out_dst        # {'tp': Shard(dim=-1)}
        """
        from fxshard.plan.importers.torchtitan_plan import specs_from_torchtitan  # torchtitan is optional: import it on use

        entries = specs_from_torchtitan(mesh, model, **kw)
        return cls(mesh, entries.specs, inputs=entries.inputs)


def is_layout(v, axes: Mapping[str, int]) -> bool:
    """Is ``v`` one layout (``{axis: Placement}``) rather than layouts by argument or
    output name?  ``{"input": Replicate()}`` on a ``("tp",)`` mesh is by name: its key
    is not a mesh axis."""
    return isinstance(v, Mapping) and all(isinstance(p, Placement) for p in v.values()) and all(k in axes for k in v)
