"""Conformance on code fxshard did not write: ``third_party`` (models from other libraries,
with their own plans or :func:`fxshard.auto_plan`'s), a layer above the planner, whose
``auto_plan`` it uses; ``fxshard.testing`` stays below the trainer.

Example::

    from fxshard.conformance.third_party import cases
"""
