"""`lipstream render | broadcast --server URL`: which flags a server's job takes, its progress bar, the report.

The command modules hand a program here when --server (or $LIPSTREAM_SERVER) is given; the job
itself is lipstream.client.jobs'. Nothing here or there imports torch: a remote render costs the
client what an HTTP client costs.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from lipstream.cli.common import err, out
from lipstream.render.options import RenderOptions
from lipstream.errors import UsageError
from lipstream.render.script import Program

# flags of a local render that a server's job does not take, and why (--fps, --crf, --x264-preset and
# --start-frame are sent with the job)
LOCAL_ONLY = {
    "--avatars": "the avatars are the server's: GET /v1/avatars lists them",
    "--reference": "the server's engine computes the frames",
    "--batch": "the server's engine sets its batches",
    "--encoders": "the server's machine sets its encoders",
    "--encoder-processes/--encoder-threads": "the server's machine sets its encoders",
    "--compile/--no-compile": "the server's engine is compiled or not when it starts",
    "--decode-rows": "the server's engine decodes as it was started",
    "--models": "the server's networks are its own",
    "--random-weights": "the server's networks are its own",
    "--random-size": "the server's networks are its own",
    "--device": "the server's engine runs on its own device",
    "--timings": "it times a render in this process",
}


def refuse_local_options(given: dict[str, bool], from_env: bool) -> None:
    """A UsageError naming the first flag given (`given`: flag -> set to something else than its default)
    that only a local render takes: never a remote render that silently ignores what was asked."""
    for flag, is_set in given.items():
        if is_set:
            where = "--server (here $LIPSTREAM_SERVER)" if from_env else "--server"
            raise UsageError(f"{flag}: not with {where}: {LOCAL_ONLY[flag]}; leave {flag} out, or render here "
                             "without --server")


class JobProgress:
    """The job's progress on stderr: a rich bar on a terminal; elsewhere (a log, a CI run) a plain line at
    each change of status and each tenth of the frames, which a log keeps readable."""

    def __init__(self, console: Console, url: str):
        self.console, self.url = console, url
        self.bar: Progress | None = None
        self.task = None
        self.last: tuple[str, int] | None = None

    def __enter__(self) -> JobProgress:
        if self.console.is_terminal:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                TimeElapsedColumn(), console=self.console, transient=False)
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, job: dict) -> None:
        status, done = job["status"], float(job.get("progress") or 0.0)
        description = f"job {job['id']} ({job['kind']}) {status}"
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task(description, total=100)
            self.bar.update(self.task, description=description, completed=100 * done)
            return
        step = (status, int(done * 10))
        if step != self.last:
            self.last = step
            self.console.print(f"{description} {100 * done:.0f}%", highlight=False)


def render_on_server(program: Program, kind: str, output: Path, options: RenderOptions, start_frame: int,
                     server: str, api_key: str | None, model: str = "musetalk") -> None:
    """Hand the render to the server: checks, upload, progress, the MP4 written as a local render writes it."""
    from lipstream.client.jobs import JobServer, OutputOptions, run_job
    from lipstream.client.upload import prepare_upload

    upload = prepare_upload(program, kind, output)
    for note in upload.notes:
        err.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    wanted = OutputOptions(fps=options.fps, crf=options.crf, x264_preset=options.x264_preset, start_frame=start_frame,
                           model=model)

    def uploading(upload) -> None:
        files = len(upload.audio) + len(upload.files) + (upload.script is not None)
        err.print(f"uploading {files} file{'s' * (files > 1)} ({upload.bytes / 1e6:.2f} MB) to {server}",
                  highlight=False)

    with JobServer(server, api_key) as remote, JobProgress(err, server) as progress:
        result = run_job(remote, upload, wanted, output, on_update=progress, on_upload=uploading)
    on_server = f"{result.server_s:.2f} s on the server" if result.server_s is not None else "on the server"
    out.print(f"wrote {result.output}: {result.frames} frames at {result.fps} fps ({result.duration_s:.2f} s of "
              f"audio), job {result.job_id} at {server}: {on_server}, {result.wall_s:.2f} s with the upload and "
              "download", highlight=False, soft_wrap=True)
