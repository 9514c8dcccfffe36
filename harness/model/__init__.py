"""The model: a routed byte-level GPT, its analytic FLOPs and KV-cached decoding.

Owns: ``gpt`` (blocks, routed blocks, the GPT), ``flops`` (the counting conventions),
``decode`` (generation with a KV cache), ``static_decode`` (its static, sync-free step, for CUDA graphs),
``restore`` (a trained GPT from a checkpoint's state) and ``sizing`` (model shapes from FLOPs, which a study's derived
control arms are sized by). May import: ``modbench.errors``,
``modbench.config`` and ``modbench.variants``. Knows nothing of training or tracking.
"""
