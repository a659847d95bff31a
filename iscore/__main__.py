"""`python -m iscore`: the `iscore` command."""

import sys

from iscore.cli import main

sys.exit(main())
