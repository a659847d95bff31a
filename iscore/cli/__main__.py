"""`python -m iscore.cli`: the `iscore` command."""

import sys

from iscore.cli import main

sys.exit(main())
