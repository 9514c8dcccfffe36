"""What a study compares: the study file, its arms, its derived controls, its claims' words.

Owns: ``arm`` (every axis of an arm declared once, and what is derived from the declarations),
``study_file`` (the study file's schema and its one loader, ``StudySpec``), ``controls`` (the
control arms a study derives, sized by the model's FLOPs) and ``vocabulary`` (what claims are
reported and chosen on, which variant controls which). May import: ``modbench.errors``,
``results``, ``config``, ``data``, ``variants`` and ``model``. The study runner and the report
import this package; it imports neither.
"""
