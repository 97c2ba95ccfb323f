"""``python -m tplib``: the command line (see :mod:`tplib.cli`)."""

from tplib.cli import main

raise SystemExit(main())
