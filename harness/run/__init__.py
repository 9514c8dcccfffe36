"""One training run: data batches, the training loop, evaluation, causal calibration, DDP.

Owns: ``train`` (the loop in phases), ``evaluate`` and ``causal_eval`` (fixed-window metrics,
top-k and causal), ``distributed`` (torchrun glue), ``heatmap`` (routing artifact). May import:
``modbench.errors``, ``config``, ``data``, ``variants``, ``model`` and ``track``.
"""
