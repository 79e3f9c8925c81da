"""``python -m fp4moe.cli``."""

import sys

from fp4moe.cli import main

sys.exit(main())
