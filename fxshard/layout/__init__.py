"""Layouts of values on the mesh and the rules that propagate them through ops.

``placements`` (a layout ``{axis: Placement}``: checking, local shapes, formatting),
``op_rules`` (fxshard's rule per op, one module per op family filling one table, used by
``passes/propagate``), ``dtensor_rules`` (DTensor's own sharding propagation, asked
where fxshard has no rule).
"""
