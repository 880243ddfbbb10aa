"""``python -m glassloop`` (what ``torchrun -m glassloop`` runs)."""

from glassloop.cli.main import main

raise SystemExit(main())
