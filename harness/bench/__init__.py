"""Speed tools: the block profiler and the benchmark table (time ratio vs FLOP ratio).

Owns: ``profile_block``, ``table``, ``decode_roofline``, ``decode_calibration`` (routers moved to a
capacity for timing decoding) and ``gpu_decode`` (the GPU decode bench: old decoder vs the static step).
May import: ``modbench.errors``, ``config``, ``variants`` and ``model`` (FLOPs come from the model's own counter).
"""
