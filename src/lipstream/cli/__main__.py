"""`python -m lipstream.cli`: the `lipstream` program."""

from lipstream.cli import entry

entry()
