"""Recursive transformers: which physical block each layer position of the stack runs.

A recursive model applies one shared *recursion block* of ``b`` layers ``N_R`` times
(Mixture-of-Recursions, Bae et al. 2025, arXiv:2507.10524 §2.1; the sharing strategies as the
authors' released code builds them, raymin0223/mixture_of_recursions
``model/sharing_strategy/llama.py`` and ``model/mor_model/modeling_llama.py``):

    cycle         the whole stack is the block, cycled:        [0 1 | 0 1 | 0 1]      (L = N_R·b)
    middle_cycle  first and last layers unshared, the middle   [0 | 1 2 | 1 2 | 1 2 | 3]
                  cycled (MoR's default):                                             (L = 2 + N_R·b)

Two depths, stated once (``ModelConfig``):

- *effective depth* L = ``ModelConfig.layers``: the number of block applications on a token's
  residual stream, the unrolled stack. Every layer position of ``GPT.layers`` is one application
  with its own KV cache, routing and FLOPs; a layer pattern (``RoutingConfig.pattern``) addresses
  these positions.
- *physical depth* = ``ModelConfig.physical_layers``: the distinct blocks that hold parameters
  (``b`` for cycle, ``b + 2`` for middle_cycle, L without recursion).

The released code derives its recursive models from a vanilla model of the same effective depth
(``num_hidden_layers``) and width, then ties weights; modbench does the same, so a recursive
model and its vanilla twin have the same width, the same FLOPs per token and the same
hyper-parameters, and differ only in the sharing (and the parameter count). When L does not
split into N_R applications the released code drops layers with a warning; modbench refuses such a
depth in one line instead.
"""

from __future__ import annotations

from modbench.config.model import unshared_layers


def block_depth(layers: int, mode: str, recursions: int) -> int:
    """b: layers in the shared recursion block (``layers`` when there is no recursion)."""
    if mode == "none":
        return layers
    return (layers - unshared_layers(mode)) // recursions


def sharing_map(layers: int, mode: str, recursions: int) -> tuple[int, ...]:
    """For each of the ``layers`` positions of the unrolled stack, the physical block it runs.

    >>> sharing_map(8, "middle_cycle", 3)
    (0, 1, 2, 1, 2, 1, 2, 3)
    >>> sharing_map(4, "cycle", 2)
    (0, 1, 0, 1)
    """
    if mode == "none":
        return tuple(range(layers))
    b = block_depth(layers, mode, recursions)
    cycled = [i % b for i in range(recursions * b)]
    if mode == "cycle":
        return tuple(cycled)
    return (0, *(1 + i for i in cycled), b + 1)


def recursion_step(layers: int, mode: str, recursions: int) -> tuple[int | None, ...]:
    """For each position, which application of the shared block it belongs to (0 … N_R−1), or
    None for an unshared layer (every layer without recursion)."""
    if mode == "none":
        return (None,) * layers
    b = block_depth(layers, mode, recursions)
    steps = [i // b for i in range(recursions * b)]
    return tuple(steps) if mode == "cycle" else (None, *steps, None)
