"""The ``modbench`` command line: one module per subcommand, registered by ``main``.

The top of the import graph: may import every other package; nothing imports it.
"""
