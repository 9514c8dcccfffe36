"""``python -m modbench.cli`` (what torchrun launches with ``-m``)."""

import sys

from modbench.cli.main import main

sys.exit(main())
