"""The training run around a sharded program.

``grad_norm`` (``clip_grad_norm_`` / ``grad_norm`` over every rank's pieces, counted once),
``accumulate`` (``no_sync``: gradient accumulation without the data-parallel syncs),
``batch`` (``shard_inputs``: this rank's share of a global batch), ``checkpointing``
(``checkpoint_blocks``: activation checkpointing per transformer block), ``fsdp``
(``fully_shard``: FSDP2 on the blocks of a transformed program), ``compile``
(``fxshard.compile``: one compiled graph per transformer block), ``token_loss``
(``token_loss_sum``: the causal-LM loss the trainer takes and the planner measures).
"""
