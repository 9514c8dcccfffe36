"""A trained GPT back from a training checkpoint's state (``modbench.track.checkpoint`` reads the file)."""

from __future__ import annotations

from modbench.config.run import RunConfig
from modbench.errors import ModbenchError
from modbench.model.gpt import GPT


def model_from_state(state: object, where: str) -> tuple[GPT, RunConfig]:
    """The GPT a checkpoint's state holds, weights loaded and in eval mode, and its run config.
    ``where`` names the file in the one-line errors: a state that is not a modbench training
    checkpoint, or weights that do not fit this version's model."""
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise ModbenchError(f"{where} is not a modbench training checkpoint (no 'model' and 'config' entries)")
    cfg = RunConfig.from_dict(state["config"], where=where)
    model = GPT(cfg.model, cfg.routing)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise ModbenchError(f"checkpoint {where} does not fit this version's model ({first})") from None
    return model.eval(), cfg
