"""Study files shipped with modbench (``modbench.studies``): TOML, read with importlib.resources."""
