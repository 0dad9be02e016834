"""`python -m rmm.cli` is the `rmm` command (kept for scripts written against 0.1)."""

from rmm.cli import main

raise SystemExit(main())
