"""Layout rules: how each op maps the layouts of its inputs to the layout of its output.

One rule per family of ops, in one table (:mod:`.table`) that each family fills with
:func:`~fxshard.layout.op_rules.table.register_rule` next to the rule's definition, as
DTensor's ``torch/distributed/tensor/_ops/`` does with ``register_op_strategy``:

============== ==========================================================================
module         ops
============== ==========================================================================
``pointwise``  arithmetic, activations, casts (and Replicate operands expanded sharded)
``matmul``     ``F.linear`` (column-, row-parallel), ``matmul``, ``bmm``, ``outer``
``reductions`` ``sum``/``mean``/``amax``, ``softmax``, ``layer_norm``/``rms_norm``, cross-entropy
``reshapes``   ``view``/``reshape``, ``transpose``/``permute``, ``expand``, ``split``, ``cat``, ``narrow``
``indexing``   ``x[idx]``, ``F.embedding``
``attention``  ``F.scaled_dot_product_attention``, the sliding-window mask
``factories``  ``arange``/``zeros``/..., ``*_like``, ``new_*``, ``tril``/``triu``, ``copy_``
``numbers``    Python numbers and sizes (``x.size(-1)``, ``math.sqrt(k)``, ``n // 2``)
``measured``   values whose shape only is read (``torch.ones_like(att[0, 0])``)
============== ==========================================================================

A rule sees a :class:`~fxshard.layout.op_rules.context.Ctx` and returns the output
layout (a complete dict), a list of layouts for tuple outputs, or a
:class:`~fxshard.meta.SizeInfo` for ints read from shapes.  A rule never changes a layout
to make an op fit: when an op cannot run on what it receives, it raises a PlanError
through ``ctx.fail`` that names the node and says which plan change would make it fit.
A rule never edits the graph either: where its layout holds only once the graph changes,
it asks the pass that makes the change (``ctx.request_rewrite``, :class:`fxshard.meta.Rewrite`).

Example::

    from fxshard.layout.op_rules import RULES, rule_for
    name, rule = rule_for(node)            # ("linear", <function linear>) for an F.linear node
    layout = rule(Ctx(node, {"tp": 2}))    # {"tp": Shard(2)} for a column-parallel linear

This package's names are what ``passes/`` import: the table, and the helpers of the
families that ``propagate``, ``localize`` and ``replicate_heads`` share.
"""
from fxshard.layout.op_rules.context import Ctx, reduce_fix
from fxshard.layout.op_rules.table import INT_RULES, METHOD_RULES, RULES, register_rule, rule_for
from fxshard.layout.op_rules import (attention, factories, indexing, matmul, numbers, pointwise,  # noqa: F401 - each
                                     reductions, reshapes)  # fills the table with its rules
from fxshard.layout.op_rules.numbers import rank_dependent_numbers, scalar_value
from fxshard.layout.op_rules.reshapes import piece_sizes, view_groups
from fxshard.layout.op_rules.indexing import block_slice
from fxshard.layout.op_rules.factories import FILL_LIKE
from fxshard.layout.op_rules.measured import measured_rule, measures, views

__all__ = ["Ctx", "RULES", "METHOD_RULES", "INT_RULES", "register_rule", "rule_for", "reduce_fix", "rank_dependent_numbers",
           "scalar_value", "piece_sizes", "view_groups", "block_slice", "FILL_LIKE", "measured_rule", "measures", "views"]
