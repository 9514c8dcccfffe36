"""The model: a routed byte-level GPT, its analytic FLOPs and KV-cached decoding.

Owns: ``gpt`` (blocks, routed blocks, the GPT), ``grouped_mm`` (a mixture of experts' bf16 grouped GEMMs and
their FLOP formula), ``flops`` (the counting conventions), ``kv_sharing`` and ``recursion`` (recursive models),
``decode`` (generation with a KV cache), ``static_decode`` (its static, sync-free step, for CUDA graphs),
``static_cache`` (that step's KV caches), ``cuda_graphs`` (CUDA-graph capture: that step's and the
bench's reference decoder's), ``restore`` (a trained GPT from a checkpoint's state) and ``sizing`` (model
shapes from FLOPs, which a study's derived control arms are sized by). May import: ``modbench.errors``,
``modbench.config`` and ``modbench.variants``. Knows nothing of training or tracking.
"""
