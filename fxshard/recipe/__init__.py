"""The training recipe: what ``python -m fxshard train`` runs for a mesh, and what
``fxshard.plan_parallelism`` predicts -- one typed object under both.

* ``parallel_dims``: :class:`~fxshard.recipe.parallel_dims.ParallelDims`, the degree of each
  axis (``AXES``: the mesh's dim order), read from ``--mesh``, and its one
  :meth:`~fxshard.recipe.parallel_dims.ParallelDims.check` of what the model, the batch and the
  sequence must divide (a :class:`~fxshard.recipe.parallel_dims.MeshError`);
* ``plan_for_mesh``: the plan of each mesh (Megatron's tensor parallelism with sequence- and
  loss-parallel regions, context parallelism, the data-parallel inputs, FSDP2's axes), and
  what the loop and the planner read off it (``sharded_logits``).

The loss both take is ``fxshard.training.token_loss``.

Example::

    dims = ParallelDims.parse("dp=2,tp=2", world_size=4)
    dims.check(batch=8, seq=512, heads=32)
    plan = plan_for_mesh(model, dims, mesh)        # over the mesh's dp and tp
"""
