"""The model: a routed byte-level GPT, its analytic FLOPs and KV-cached decoding.

Owns: ``gpt`` (blocks, routed blocks, the GPT), ``flops`` (the counting conventions) and
``decode`` (generation with a KV cache). May import: ``modbench.errors``,
``modbench.config`` and ``modbench.variants``. Knows nothing of training or tracking.
"""
