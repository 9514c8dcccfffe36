"""Reports: statistics, tables and figures read from a study's stored results.

One way through, data flowing down: ``collect`` (Optuna + MLflow rows into pandas), ``measure``
(decode costs and routing masks on the trials' checkpoints), ``data_files`` (both saved beside the
report, read back by a re-render), ``sections`` (every section's numbers, built on ``stats`` and
``stats_text`` (scipy statistics and their sentences), ``effects`` (differences with CIs,
Holm/Dunnett, MDE), ``baselines`` (n-gram and compressor bits per byte), ``isoflop`` (profiles),
``claims`` (a study's declared claims and verdicts)), ``render`` (the markdown), ``figures`` (every
figure, from the computed data) and ``build`` (the steps in order). May import: ``modbench.errors``,
``config``, ``data``, ``model``, ``design`` (what a study compares) and ``track``; never ``run`` or
``study.runner`` (a report reads results, it does not train).
"""
