"""Results: where a run's record, metrics and checkpoint are written and read back.

Owns: the MLflow tracker (``tracking``), its file-backed twin for a machine without MLflow
(``offline``, with the import into a store), the process ``modbench train`` runs the tracker in
(``background``), tracking URIs and store checks (``store``), checkpoints (``checkpoint``) and
provenance tags (git sha, environment). May import: ``modbench.errors`` and ``modbench.config``. Both the
trainer (writing) and the report (reading) import this package, never each other.
"""
