"""Studies: a study file's grid or search run as Optuna trials, each trial one run.

Owns: ``runner`` (creation, queueing, workers, heartbeats, retries, deadlines), ``tuning`` (the
stages), ``points``, ``slot`` (a study on one lent GPU: workers, deadline, archive, import) and
``workers_probe`` (how many workers share one GPU). May import:
``modbench.errors``, ``config``, ``data``, ``model`` (``sizing``: derived control arms), ``run``, ``track``
and ``report`` (the tuning stages select on the claims' metric, fit the isoFLOP profile and size seeds
with the report's statistics: one definition of each).
"""
