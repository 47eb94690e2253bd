"""``python -m deltasync`` is the ``deltasync`` console script."""

from deltasync.cli import main

raise SystemExit(main())
