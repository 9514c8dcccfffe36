"""Studies: a study file's grid or search run as Optuna trials, each trial one run.

Owns: ``runner`` (creation, queueing, workers, heartbeats, retries). May import:
``modbench.errors``, ``config``, ``data``, ``model`` (``sizing``: derived control arms), ``run``, ``track``
and ``report`` (the tuning stages select on the claims' metric, fit the isoFLOP profile and size seeds
with the report's statistics: one definition of each).
"""
