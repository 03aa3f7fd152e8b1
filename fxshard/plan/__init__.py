"""The plan: a device mesh and, per module, where its tensors live on it.

``specs`` (the entries: ``ModuleSpec`` and its constructors ``colwise``, ``rowwise``, ...;
FQN patterns), ``plan`` (``Plan``: entries checked against the mesh, the importers'
``Plan.from_hf`` / ``from_torch`` / ``from_torchtitan``), ``mesh`` (``MeshSpec``: a mesh
without processes, for planning offline), ``auto_plan`` (a plan read off the graph).
"""
