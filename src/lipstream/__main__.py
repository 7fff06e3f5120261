"""`python -m lipstream`: the command line."""

from lipstream.cli import main

raise SystemExit(main())
