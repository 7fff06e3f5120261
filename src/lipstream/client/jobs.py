"""Render and broadcast jobs handed to a running `lipstream serve` (`lipstream render --server URL`).

A render on a machine without a GPU, or one that must not wait for networks to load, goes to the
server that holds them warm. What the user gave is checked first, as a local render checks it
(upload.py: the output path, each audio file, plus a header probe of each file, since the upload
is what costs), then against the server's avatars (GET /v1/avatars), and only then uploaded
(POST /v1/jobs/render or /v1/jobs/broadcast). The job's server-sent events drive the caller's
progress; the result is downloaded into the output exactly as a local render writes one: a
temporary name beside it, renamed when complete and removed on any failure or Ctrl-C. A job that
is not finished when anything goes wrong (Ctrl-C included) is cancelled on the server, so nothing
runs on for an output nobody will take.

Every refusal is one line (a LipStreamError) that names the server. No torch: httpx and PyAV (the
result's frame count).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from lipstream.client.upload import Upload, check_avatars
from lipstream.errors import LipStreamError, UsageError, require
from lipstream.files import atomic_path

require("serve", "lipstream.client", "httpx")

import httpx  # noqa: E402  (after the one-line hint that names the extra)

log = logging.getLogger(__name__)

TERMINAL = ("done", "failed", "cancelled")
TIMEOUT_S = 60.0  # a request's connect, read and write limits (an upload of the largest file the server takes)
EVENTS_READ_S = 60.0  # the events stream sends a keep-alive every 15 s: this long silent is a server gone
RECONNECTS = 5  # the events stream broken this many times in a row: the server is gone
CANCEL_TIMEOUT_S = 5.0
# a job's output options as the jobs API names them -> the flag a user typed
FLAGS = {"fps": "--fps", "crf": "--crf", "x264_preset": "--x264-preset", "start_frame": "--start-frame",
         "model": "--model"}
DEFAULT_CRF = 18
# how a user of `lipstream render | broadcast --server` gives the server's key
KEY_OPTION = "pass --api-key KEY (or set LIPSTREAM_API_KEY)"


class RemoteError(LipStreamError):
    """The server refused or failed the job, or could not be reached."""


def key_refusal(url: str, status: int, key_given: bool, how: str = KEY_OPTION) -> str:
    """The one line for a 401 or 403: the server wants a key, or refused the one given. `how`: how this
    caller gives a key (a flag and a variable, a keyword argument)."""
    if key_given:
        return f"{url} answered {status}: it refused the API key given (not one of its keys): {how}"
    return f"{url} answered {status}: it wants an API key: {how}"


@dataclass(frozen=True)
class OutputOptions:
    """What the jobs API takes of a render's options (None: the server's choice, as a local render leaves
    them to the machine). A crf of 18 and a start frame of 0 are everyone's defaults and are not sent, so
    a server that predates these options still takes a render that asks for none of them."""

    fps: Fraction | None = None
    crf: int = DEFAULT_CRF
    x264_preset: str | None = None
    start_frame: int = 0
    model: str = "musetalk"

    def form(self, kind: str) -> dict[str, str]:
        """The form fields to send: only what differs from the defaults (start_frame: render jobs only)."""
        out: dict[str, str] = {}
        if self.fps is not None:
            out["fps"] = str(self.fps)
        if self.crf != DEFAULT_CRF:
            out["crf"] = str(self.crf)
        if self.x264_preset is not None:
            out["x264_preset"] = self.x264_preset
        if kind == "render" and self.start_frame:
            out["start_frame"] = str(self.start_frame)
        if self.model != "musetalk":
            out["model"] = self.model
        return out


@dataclass(frozen=True)
class RemoteResult:
    """What a finished remote job wrote: the output's frames and rate (read back from the file), the
    server's time on the job (started to finished) and the whole wall time here (upload to renamed)."""

    output: Path
    job_id: str
    frames: int
    fps: Fraction
    duration_s: float
    bytes: int
    server_s: float | None
    wall_s: float


def server_url(value: str, option: str = "--server") -> str:
    """The base URL of a server (no trailing slash); a UsageError naming the option for anything else."""
    url = value.strip().rstrip("/")
    if not re.fullmatch(r"https?://[^/\s?#]+(/[^\s?#]*)?", url):
        raise UsageError(f"{option} {value!r}: expected the server's address, http://HOST:PORT")
    return url


@dataclass
class JobServer:
    """A running `lipstream serve` as its jobs API sees it: one HTTP client with the bearer key, every
    answer that is not the one asked for turned into a one-line RemoteError naming the server."""

    url: str
    api_key: str | None = None
    key_how: str = KEY_OPTION  # how its user gives the key, for the line a 401 or 403 ends in
    http: httpx.Client = field(init=False, repr=False)

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(TIMEOUT_S, connect=10.0))

    def __enter__(self) -> JobServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        try:
            yield
        except httpx.TransportError as e:
            raise RemoteError(f"cannot reach the server at {self.url}: {_why(e)}") from None

    def avatars(self) -> list[dict]:
        """GET /v1/avatars: the resident avatars (name, width, height, fps). Also the first check that the
        server is there, is a lipstream serve and takes the key, before anything is uploaded."""
        with self._reaching():
            r = self.http.get("/v1/avatars")
        if r.status_code == 404:
            raise RemoteError(f"the server at {self.url} has no /v1/avatars (404): is it a `lipstream serve`?")
        if r.status_code != 200:
            raise self.refusal(r, "list its avatars")
        try:
            listing = r.json()
            return [a for a in listing if isinstance(a, dict) and "name" in a]
        except (ValueError, TypeError):
            raise RemoteError(f"the server at {self.url} answered GET /v1/avatars with something that is not "
                              "a list of avatars: is it a `lipstream serve`?") from None

    def submit(self, upload: Upload, options: OutputOptions) -> dict:
        """POST the job with its files; the job as the server lists it. The output options sent must come
        back in it (`options`): a server that ignored one would render something else than was asked."""
        form = options.form(upload.kind)
        with contextlib.ExitStack() as files_open, self._reaching():
            files = [(part, (name, files_open.enter_context(open(path, "rb")), "application/octet-stream"))
                     for part, named in (("audio", upload.audio), ("files", upload.files))
                     for name, path in named.items()]
            if upload.kind == "render":
                r = self.http.post("/v1/jobs/render", data={"avatar": upload.avatar, **form}, files=files)
            else:
                files.insert(0, ("script", ("script.yaml", upload.script.encode(), "application/yaml")))
                r = self.http.post("/v1/jobs/broadcast", data=form, files=files)
        if r.status_code != 202:
            raise self.refusal(r, f"take the {upload.kind} job")
        job = r.json()
        taken = job.get("options")
        ignored = [FLAGS[k] for k in form if taken is None or str(taken.get(k)) != form[k]]
        if ignored:
            self.cancel(job["id"])
            raise RemoteError(f"the server at {self.url} does not take {', '.join(ignored)} (an older "
                              "`lipstream serve`?): leave them out, or upgrade the server")
        return job

    def events(self, job_id: str) -> Iterator[dict]:
        """The job each time it changes (GET /v1/jobs/{id}/events, server-sent events), until it is done,
        failed or cancelled. A broken stream is opened again (the first event is the job as it is now);
        RECONNECTS breaks in a row and the server is taken for gone."""
        breaks = 0
        while True:
            try:
                with self.http.stream("GET", f"/v1/jobs/{job_id}/events",
                                      timeout=httpx.Timeout(TIMEOUT_S, read=EVENTS_READ_S)) as r:
                    if r.status_code != 200:
                        r.read()
                        raise self.refusal(r, f"follow job {job_id}")
                    for line in r.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        job = json.loads(line[5:])
                        breaks = 0
                        yield job
                        if job["status"] in TERMINAL:
                            return
                why = "the stream ended before the job did"
            except httpx.TransportError as e:
                why = _why(e)
            breaks += 1
            if breaks >= RECONNECTS:
                raise RemoteError(f"lost the server at {self.url} while job {job_id} ran ({why}); it may still "
                                  f"finish: GET {self.url}/v1/jobs/{job_id}")
            time.sleep(1.0)

    def download(self, job_id: str, dest: Path) -> int:
        """The job's MP4 into `dest` (the output's temporary name); its size, checked against the server's."""
        with self._reaching(), self.http.stream("GET", f"/v1/jobs/{job_id}/result") as r:
            if r.status_code != 200:
                r.read()
                raise self.refusal(r, f"send job {job_id}'s result")
            expected = int(r.headers.get("content-length", -1))
            size = 0
            with open(dest, "wb") as f:
                for chunk in r.iter_bytes(1 << 20):
                    f.write(chunk)
                    size += len(chunk)
        if expected >= 0 and size != expected:
            raise RemoteError(f"job {job_id}'s result from {self.url} was cut short ({size} of {expected} bytes)")
        return size

    def cancel(self, job_id: str) -> bool:
        """DELETE the job (best effort, a short wait): True when the server took the cancel."""
        try:
            r = self.http.delete(f"/v1/jobs/{job_id}", timeout=CANCEL_TIMEOUT_S)
        except httpx.HTTPError as e:  # the server is gone (the reason the job stopped here): nothing to cancel
            log.info("could not cancel job %s on %s: %s", job_id, self.url, _why(e))
            return False
        if r.status_code != 200:
            log.warning("could not cancel job %s on %s (%d): %s", job_id, self.url, r.status_code, _detail(r))
        return r.status_code == 200

    def refusal(self, r: httpx.Response, action: str) -> RemoteError:
        """A one-line error for an answer that is not the one asked for: a key missing or refused, a server
        full (with when to try again), or the server's own reason."""
        detail = _detail(r)
        status = r.status_code
        if status in (401, 403):
            return RemoteError(key_refusal(self.url, status, bool(self.api_key), self.key_how))
        if status in (429, 503):
            after = r.headers.get("retry-after")
            when = f"try again in {after} s" if after else "try again later"
            return RemoteError(f"the server at {self.url} is busy ({status}): {detail}; {when}")
        return RemoteError(f"the server at {self.url} would not {action} ({status}): {detail}")


def run_job(server: JobServer, upload: Upload, options: OutputOptions, output: Path,
            on_update: Callable[[dict], None] = lambda job: None,
            on_upload: Callable[[Upload], None] = lambda upload: None) -> RemoteResult:
    """The whole job: avatars checked, the output's temporary file made (an unwritable folder fails now,
    before the upload), the upload, progress to `on_update` (the job each time it changes), the result
    downloaded and renamed into `output`. Anything that stops it once submitted, Ctrl-C included, cancels
    the job on the server unless it had ended; the temporary file goes either way."""
    t0 = time.monotonic()
    check_avatars(upload, server.avatars(), server.url)
    with atomic_path(output) as tmp:
        on_upload(upload)
        job = server.submit(upload, options)
        try:
            on_update(job)
            for job in server.events(job["id"]):
                on_update(job)
        except BaseException:
            if job["status"] not in TERMINAL:
                server.cancel(job["id"])
            raise
        if job["status"] == "failed":
            raise RemoteError(f"the job failed on the server at {server.url}: {job.get('error') or 'no reason given'}")
        if job["status"] == "cancelled":
            raise RemoteError(f"job {job['id']} was cancelled on the server at {server.url}")
        size = server.download(job["id"], tmp)
        frames, fps, duration = mp4_summary(tmp, server.url)
    server_s = (job["finished_at"] - job["started_at"]) if job.get("finished_at") and job.get("started_at") else None
    return RemoteResult(output, job["id"], frames, fps, duration, size, server_s, time.monotonic() - t0)


def mp4_summary(path: Path, url: str) -> tuple[int, Fraction, float]:
    """(video frames, frame rate, audio seconds) of a downloaded result: it is read back before it takes
    the output's name, so what the server sent is a video, not an error page."""
    import av

    try:
        with av.open(str(path)) as c:
            video = c.streams.video[0]
            audio = c.streams.audio[0] if c.streams.audio else None
            frames = video.frames or sum(1 for p in c.demux(video) if p.size)
            seconds = float(audio.duration * audio.time_base) if audio is not None and audio.duration else 0.0
            return frames, Fraction(video.average_rate or 0), seconds
    except (av.FFmpegError, IndexError) as e:
        raise RemoteError(f"the result from {url} is not a readable MP4 ({type(e).__name__}: {e})") from None


def _detail(r: httpx.Response) -> str:
    """The server's reason: FastAPI's `detail` (a string, or its validation errors), else the body's first line."""
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        detail = f"{'.'.join(str(x) for x in first.get('loc', [])[1:]) or 'request'}: {first.get('msg', '')}"
    text = str(detail) if detail else (r.text.strip().splitlines() or [r.reason_phrase or "no reason given"])[0]
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:299] + "…"


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{text} ({type(e).__name__})" if text else type(e).__name__
