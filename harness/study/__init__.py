"""Studies: a study file's grid or search run as Optuna trials, each trial one run.

Owns: ``runner`` (creation, queueing, workers, heartbeats, retries). May import:
``modbench.errors``, ``config``, ``data``, ``model`` (``sizing``: derived control arms), ``run`` and ``track``.
"""
