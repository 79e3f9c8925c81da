"""``python -m fp4moe``: the ``fp4moe`` command."""

import sys

from fp4moe.cli import main

sys.exit(main())
