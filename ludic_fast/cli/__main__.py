"""`python -m ludic_fast.cli` = the `ludic-fast` command."""

import sys

from ludic_fast.cli import main

sys.exit(main())
