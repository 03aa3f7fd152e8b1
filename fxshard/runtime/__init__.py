"""What the generated program calls at run time (every op reads ``fxshard.<name>`` in
``print(gm.code)``).

``collectives`` (the bound mesh, all-reduce/all-gather/reduce-scatter/all-to-all as
autograd ops, gradient syncs and their buckets), ``loss`` (vocab-parallel and global-mean
cross-entropy), ``context_parallel_ops`` (sequence split and gather, ring attention,
positions and masks of the local sequence), ``moe`` and ``routed_experts`` (expert
parallelism: the dispatch and combine all-to-alls and the experts' local forward).
"""
