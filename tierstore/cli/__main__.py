"""``python -m tierstore.cli``: the same as the ``tierstore`` command."""

import sys

from tierstore.cli.main import main

sys.exit(main())
