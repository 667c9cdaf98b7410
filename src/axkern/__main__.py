"""`python -m axkern`: the `axkern` command."""

import sys

from axkern.cli import main

if __name__ == "__main__":
    sys.exit(main())
