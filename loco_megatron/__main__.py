"""``python -m loco_megatron ...``: the package's command line
(:mod:`loco_megatron.cli.command`)."""

import sys

from .cli.command import main

if __name__ == "__main__":
    sys.exit(main())
