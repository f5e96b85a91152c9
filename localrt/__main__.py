"""`python -m localrt` is the same program as `localrt`."""

import sys

from localrt.cli import main

if __name__ == "__main__":
    sys.exit(main())
