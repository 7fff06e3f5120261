"""`python -m lipstream`: the command line."""

from lipstream.cli import entry

entry()
