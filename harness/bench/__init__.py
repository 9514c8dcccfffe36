"""Speed tools: the block profiler and the benchmark table (time ratio vs FLOP ratio).

Owns: ``profile_block`` and ``table``. May import: ``modbench.errors``, ``config``,
``variants`` and ``model`` (FLOPs come from the model's own counter).
"""
