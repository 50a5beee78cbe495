"""``python -m dp_budget_provider.cli``: the ``dp-budget`` command."""

import sys

from dp_budget_provider.cli.program import main

sys.exit(main())
