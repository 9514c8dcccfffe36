"""Speed tools: the block profiler and the benchmark table (time ratio vs FLOP ratio).

Owns: ``profile_block``, ``table``, ``decode_roofline``, ``decode_calibration`` (routers moved to a
capacity for timing decoding), ``gpu_decode`` (the GPU decode bench: old decoder vs the static step, masked and
under ``torch.cond``, with ``reference_decoder``, the plain decoder its dense bar is measured against),
``gpu_bars`` (the routed block's and the model step's bars, eager, compiled and under CUDA
graphs) and ``dense_layer`` (where the dense layer's eager time goes).
May import: ``modbench.errors``, ``config``, ``variants`` and ``model`` (FLOPs come from the model's own counter), and
``track.provenance`` (the commit a table was measured at).
"""
