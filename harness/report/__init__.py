"""Reports: statistics, tables and figures read from a study's stored results.

Owns: ``collect`` (Optuna + MLflow rows into pandas), ``stats`` and ``stats_text``
(scipy statistics and their sentences), ``effects`` (differences with CIs, Holm/Dunnett, MDE),
``baselines`` (n-gram and compressor bits per byte), ``isoflop`` (profiles), ``claims`` and
``claims_report`` (a study's declared claims, verdicts and summary.json), ``figures`` (every figure),
``routing_analysis`` and ``build`` (the markdown report). May import: ``modbench.errors``, ``config``, ``data``, ``model``,
``design`` (what a study compares) and ``track``; never ``run`` or ``study.runner`` (a report reads results, it does not train).
"""
