"""`python -m sky ROLE STATE ...`: the fake's detached processes (sky._server)."""

import sys

from sky._server import main

sys.exit(main(sys.argv[1:]))
