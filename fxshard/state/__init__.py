"""A sharded program's parameters and buffers: who holds which piece, and moving them.

``shards`` (the boxes of a tensor each rank holds, and how many copies of each),
``module_state`` (names of parameters, buffers and plain tensor attributes),
``full_state`` (``full_state_dict`` / ``load_full_state_dict``), ``materialize`` (a
meta-device program made real, rank by rank), ``checkpoint`` (``save`` / ``load`` with
DCP, resharding), ``hf_checkpoint`` (safetensors of a HF checkpoint, read per shard),
``progress`` (progress bars on one rank), ``files`` (the files a checkpoint names,
read only inside its directory: ``confined_file``).
"""
