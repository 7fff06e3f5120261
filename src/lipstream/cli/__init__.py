"""The `lipstream` command line: one module per group of commands, a flag per function argument, errors in one line.

One module per group of commands (common: what they share; weights; render: compile, render, broadcast,
warmup, features; bench: bench, live-bench; serve: serve, serve-bench; livekit: livekit-worker); importing this package
registers them all on `app`.
"""

from __future__ import annotations

import logging
import os
import sys

import typer
from rich.markup import escape

# each registers its commands on `app`, in the order `lipstream --help` lists them
from lipstream.cli import render  # isort: skip
from lipstream.cli import serve  # isort: skip
from lipstream.cli import bench, weights  # isort: skip
from lipstream.cli import livekit  # isort: skip
from lipstream.cli import common  # isort: skip
from lipstream.cli.common import app, click, err, load_models, old_spellings, process_age, warn_random_weights
from lipstream.errors import LipStreamError
from lipstream.errors import UsageError
from lipstream.models.config import random_size_for

log = logging.getLogger(__name__)
__all__ = ["app", "bench", "entry", "livekit", "load_models", "main", "process_age", "random_size_for", "render",
           "serve", "warn_random_weights", "weights"]


def main(argv: list[str] | None = None) -> int:
    """Run one command; every error a user can cause ends in one line: exit 1, or 2 for usage, 130 for Ctrl-C."""
    logging.basicConfig(level=os.environ.get("LIPSTREAM_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    try:
        # standalone_mode=False: click's usage errors come here (one line) instead of a multi-line panel;
        # typer turns a KeyboardInterrupt into the return value 130.
        argv = old_spellings(sys.argv[1:] if argv is None else list(argv))
        code = app(args=argv, prog_name="lipstream", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help(), err=True)
        return 2
    except click.exceptions.UsageError as e:
        command = e.ctx.command_path if e.ctx else "lipstream"
        err.print(f"[bold red]error:[/] {escape(e.format_message())} (see `{command} --help`)", highlight=False, soft_wrap=True)
        return 2
    except UsageError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return e.exit_code
    except LipStreamError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 1
    except (KeyboardInterrupt, typer.Abort):
        code = 130
    except Exception as e:  # noqa: BLE001 - a bug, not a user's mistake: one line, the traceback on request
        log.debug("unexpected error", exc_info=True)
        text = str(e).strip().splitlines()
        err.print(f"[bold red]error:[/] unexpected {type(e).__name__}" + (f": {escape(text[0])}" if text else "")
                  + " (a bug in LipStream: LIPSTREAM_LOG=DEBUG shows the traceback)", highlight=False, soft_wrap=True)
        return 1
    if code == 130:
        err.print("interrupted: stopped, no output written", highlight=False)
    return code if isinstance(code, int) else 0


def entry() -> None:
    """The `lipstream` program. After Ctrl-C the output is already cleaned up, and after a render or broadcast
    its MP4 is complete (written, closed, renamed into place): the process then ends at once, because
    tearing down torch (and a CUDA context) took a second more and a user waits for the prompt too."""
    code = main()
    if code == 130 or (code == 0 and common.finished):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
