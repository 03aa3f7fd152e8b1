"""The plan: a device mesh and, per module, where its tensors live on it.

Two layers (docs/design.md, "Where the code lives"): the vocabulary, below everything but
the errors -- ``specs`` (the entries: ``ModuleSpec`` and its constructors ``colwise``,
``rowwise``, ...; FQN patterns), ``mesh`` (``MeshSpec``: a mesh without processes, for
planning offline), ``pipeline`` (``PipelineSpec``: the pipeline part of a plan) -- and, above
the runtime, ``plan`` (``Plan``: entries checked against the mesh) and, in ``importers/``, the
importers of other libraries' plans that ``Plan.from_hf`` / ``from_torch`` / ``from_torchtitan``
call (``importers.hf_plan``, ``importers.torch_plan``, ``importers.torchtitan_plan``).  ``fxshard.auto_plan`` (a plan read off
the graph) runs the transform, so it lives above it, in ``fxshard.planner``.
"""
