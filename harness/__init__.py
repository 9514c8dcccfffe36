"""modbench: a benchmark and ablation suite for Mixture-of-Depths routing.

The package is laid out by job; imports flow one way, top to bottom (``tests/test_imports.py``
fails on a cycle or an upward edge):

    cli      the ``modbench`` command: one module per subcommand
    study    Optuna studies: a study file's trials, workers, retries
    report   statistics, tables and figures read from stored results (never trains)
    bench    speed tools: block profiler, benchmark table
    run      one training run: loop, evaluation, causal calibration, DDP
    track    results: MLflow tracker, checkpoints, provenance
    model    the routed GPT, its FLOPs, KV-cached decoding
    config   typed frozen configs and their one loader (TOML, flags, study files)
    data     byte corpora, splits, batches, evaluation windows
    variants routers and their registry (``from modbench.variants import register_variant``)
    results  the declared metrics (``val/bpb``: unit, direction) and a run's record
    errors   ``ModbenchError``: a user's mistake, one line, exit 2
    interrupts  Ctrl-C/SIGTERM as a request acted on at safe points (training steps, trials)

In the source tree ``harness/`` holds the ``modbench`` package and ``variants/`` its
``modbench.variants`` sub-package (a setuptools ``package-dir`` mapping), and ``studies/``
ships as ``modbench.studies`` data.
"""

__version__ = "0.1.0"
