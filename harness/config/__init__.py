"""Configuration: the typed, frozen objects a run or a study is made of, and their one loader.

Owns: capacity schedules, layer patterns, budgets, the model/routing/train sections of a run,
and TOML/flag parsing (study files are ``modbench.design``'s). May import: ``modbench.errors``, ``modbench.variants``
(to resolve a variant name to its frozen config) and ``modbench.data`` (dataset names).
"""
