"""Studies: a study file's grid or search run as Optuna trials, each trial one run.

Owns: ``runner`` (creation, queueing, workers, heartbeats, retries, deadlines), ``tuning`` (the
stages), ``points``, ``slot`` (a study on one lent GPU: workers, deadline, archive, import) and
``workers_probe`` (how many workers share one GPU). May import:
``modbench.errors``, ``config``, ``data``, ``model``, ``design`` (the study file, its arms, controls and
claims' words), ``run``, ``track`` and ``report`` (its pure statistics only: the isoFLOP fit and the seed
rules, one definition of each).
"""
