import sys

from .ops.cli import main

sys.exit(main())
