"""The words a study's claims are made of, shared by the tuning protocol and the report.

Which variant is the baseline and which random variant controls which learned one are the
registry's roles (``modbench.variants``: ``role``, ``control_of``), read here once. What a claim is reported on and what "best" is chosen on, which variant the later methods are
measured against, which random variant controls which learned one, and how the positive control
is named. The protocol (``modbench.study.tuning``) plans with them and the report
(``modbench.report.claims``) tests with them: one definition, in the room of what a study compares.
"""

from __future__ import annotations

from modbench import variants

HEADLINE = "test/causal_bpb"  # what claims are reported on: the deployable (causal) rule, on test
SELECT = "val/causal_bpb"  # what "best" (size, learning rate) is chosen on: validation, never test
METHODS_REFERENCE = "sigmoid"  # the seed recipe the later methods are measured against (C4)
POSITIVE_CONTROL = "positive control"  # Arm.control of the positive control starts with this
RANDOM_CONTROL = variants.random_controls()  # learned variant -> its random control (the registry's roles)
CONTROL_VARIANTS = tuple(RANDOM_CONTROL.values())  # the random controls (C2)
DENSE = variants.baseline_variant()  # the baseline every routed arm is compared with (no routing)
