"""`python -m rmm` is the `rmm` command."""

from rmm.cli import main

raise SystemExit(main())
