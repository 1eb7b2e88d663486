"""``python -m torchport`` runs the ``torchport`` command line."""

from .cli.main import main

raise SystemExit(main())
