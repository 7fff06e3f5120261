"""Render and broadcast jobs handed to a running `lipstream serve` (`lipstream render --server URL`).

A render on a machine without a GPU, or one that must not wait for networks to load, goes to the
server that holds them warm. What the user gave is checked here first, as a local render checks it
(preflight: the output path, each audio file, plus a header probe of each file, since the upload
is what costs), then against the server's avatars (GET /v1/avatars), and only then uploaded
(POST /v1/jobs/render or /v1/jobs/broadcast). The job's server-sent events drive the caller's
progress; the result is downloaded into the output exactly as a local render writes one: a
temporary name beside it, renamed when complete and removed on any failure or Ctrl-C. A job that
is not finished when anything goes wrong (Ctrl-C included) is cancelled on the server, so nothing
runs on for an output nobody will take.

Every refusal is one line (a LipStreamError) that names the server. No torch: httpx, PyAV (a
header probe of each audio file, the result's frame count) and YAML.
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

import httpx

from lipstream.errors import InputError, LipStreamError, check_file
from lipstream.io import atomic_path
from lipstream.preflight import UsageError, check_program_inputs
from lipstream.script import Program
from lipstream.serve.options import AUDIO_SUFFIXES

log = logging.getLogger(__name__)

TERMINAL = ("done", "failed", "cancelled")
TIMEOUT_S = 60.0  # a request's connect, read and write limits (an upload of the largest file the server takes)
EVENTS_READ_S = 60.0  # the events stream sends a keep-alive every 15 s: this long silent is a server gone
RECONNECTS = 5  # the events stream broken this many times in a row: the server is gone
CANCEL_TIMEOUT_S = 5.0
# a job's output options as the jobs API names them -> the flag a user typed
FLAGS = {"fps": "--fps", "crf": "--crf", "x264_preset": "--x264-preset", "start_frame": "--start-frame"}
DEFAULT_CRF = 18


class RemoteError(LipStreamError):
    """The server refused or failed the job, or could not be reached."""


@dataclass(frozen=True)
class OutputOptions:
    """What the jobs API takes of a render's options (None: the server's choice, as a local render leaves
    them to the machine). A crf of 18 and a start frame of 0 are everyone's defaults and are not sent, so
    a server that predates these options still takes a render that asks for none of them."""

    fps: Fraction | None = None
    crf: int = DEFAULT_CRF
    x264_preset: str | None = None
    start_frame: int = 0

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
        return out


@dataclass(frozen=True)
class Upload:
    """A job's inputs as the server takes them. A render: `avatar` and one audio file. A broadcast: the
    script rewritten for the server (each audio under the name it is uploaded as, the server's avatars),
    and those files. `avatars`: every avatar the program names, in order; `notes`: what the rewrite left
    out, for the user to see."""

    kind: str
    avatars: tuple[str, ...]
    audio: dict[str, Path]  # upload name -> local file
    avatar: str | None = None
    script: str | None = None
    source: Path | None = None
    notes: tuple[str, ...] = ()
    files: dict[str, Path] = field(default_factory=dict)  # a broadcast's show files: upload name -> local file
    program: Program | None = field(default=None, repr=False)  # the show is checked against the server's frame

    @property
    def bytes(self) -> int:
        return (sum(p.stat().st_size for p in [*self.audio.values(), *self.files.values()])
                + len(self.script or ""))


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


def probe_audio(path: Path) -> Path:
    """An audio file the server can take, checked before it is uploaded: present and readable (preflight's
    check, the local render's wording), a suffix the server accepts, and a header PyAV reads with an audio
    stream in it. The samples themselves are decoded on the server (a damaged file fails the job there)."""
    from lipstream.media.demux import open_input

    path = check_file(path, "audio file")
    if path.suffix.lower() not in AUDIO_SUFFIXES:
        raise InputError(path, "with --server the audio must be a file ending in one of "
                               f"{', '.join(sorted(AUDIO_SUFFIXES))}")
    if path.stat().st_size == 0:
        raise InputError(path, "is empty (0 bytes)")
    import av

    try:
        with open_input(path) as container:
            if not any(s.type == "audio" for s in container.streams):
                raise InputError(path, "has no audio stream")
    except av.FFmpegError as e:
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise InputError(path, f"not a readable audio or video file ({why})") from None
    return path


def prepare_upload(program: Program, kind: str, output: Path) -> Upload:
    """The checks a local render makes before torch (the output path, every audio file) and the header
    probe, then the job's inputs: one file per distinct audio, named for the upload, and (a broadcast)
    one per distinct file of its show, each present and of a kind the server takes (the rest of the show's
    checks need the server's frame size: run_job makes them before the upload)."""
    check_program_inputs(program, output)
    names: dict[Path, str] = {}
    for scene in program.scenes:
        if scene.audio is None:
            continue
        key = scene.audio.resolve()
        if key not in names:
            probe_audio(scene.audio)
            names[key] = upload_name(len(names) + 1, scene.audio, "audio")
    audio = {names[scene.audio.resolve()]: scene.audio for scene in program.scenes if scene.audio is not None}
    avatars = tuple(dict.fromkeys(shot.avatar for scene in program.scenes for shot in scene.shots))
    if kind == "render":
        return Upload(kind, avatars, audio, avatar=avatars[0], source=program.source)
    notes = ()
    if program.avatars_dir is not None:
        notes = (f"{program.source}: its 'avatars: {program.avatars_dir}' is not used with --server: the avatars "
                 "are the server's",)
    shown = show_uploads(program)
    for name, path in shown.items():
        names.setdefault(path.resolve(), name)  # a file that is a scene's audio too keeps its audio name
    return Upload(kind, avatars, audio, script=server_script(program, names), source=program.source, notes=notes,
                  files=shown, program=program)


def upload_name(n: int, path: Path, fallback: str, prefix: str = "") -> str:
    """`01-intro_speech.wav`: numbered (two files of one name stay two), the stem made safe, the suffix kept."""
    from lipstream.serve.options import file_suffix

    suffix = file_suffix(path.name)
    stem = path.name[:len(path.name) - len(suffix)] if suffix else path.name
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:40] or fallback
    return f"{prefix}{n:02d}-{stem}{suffix}"


def show_uploads(program: Program) -> dict[str, Path]:
    """Upload name -> local file for every file the show reads (Show.files(): each once; a Piper voice
    with its .onnx.json beside it), each present and ending as the server takes show files."""
    from lipstream.serve.options import SHOW_SUFFIXES, show_suffix

    out: dict[str, Path] = {}
    seen: set[Path] = set()
    wanted = list(program.show.files())
    if program.show.voice and program.show.voice.lower().endswith(".onnx"):
        config = Path(program.show.voice + ".json")
        if config.is_file():
            wanted.append(config)
    for path in wanted:
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        check_file(path, "file of the show")
        if show_suffix(path.name) is None:
            raise InputError(path, "with --server a show's file must end in one of "
                                   f"{', '.join(sorted(SHOW_SUFFIXES))}")
        if path.name.lower().endswith(".onnx.json"):  # beside its voice, as Piper looks for it
            voice = next(n for n, p in out.items() if Path(str(p) + ".json").resolve() == path.resolve())
            out[voice + ".json"] = path
        else:
            out[upload_name(len(out) + 1, path, "file", "show")] = path
    return out


def server_script(program: Program, names: dict[Path, str]) -> str:
    """The broadcast script as the server takes it: the same scenes and show, each file by its upload name
    (`names`: resolved local path -> upload name), no avatars folder (the server's own)."""
    import yaml

    from lipstream.show.schema import layers_doc, show_doc

    def name(path: Path) -> str:
        return names[Path(path).resolve()]

    layers = program.show.scenes
    scenes = []
    for k, scene in enumerate(program.scenes):
        entry: dict = {"audio": name(scene.audio)} if scene.audio is not None else {"text": scene.text}
        if len(scene.shots) == 1 and scene.shots[0].at == 0:
            entry["avatar"] = scene.shots[0].avatar
        else:
            entry["cameras"] = [{"at": shot.at, "avatar": shot.avatar} for shot in scene.shots]
        if scene.start_frame:
            entry["start_frame"] = scene.start_frame
        if scene.crossfade:
            entry["transition"] = {"crossfade": scene.crossfade}
        if k < len(layers):
            entry.update(layers_doc(layers[k], name))
        scenes.append(entry)
    doc = ({"fps": str(program.fps)} if program.fps is not None else {}) | {"scenes": scenes}
    return yaml.safe_dump(doc | show_doc(program.show, name), sort_keys=False, allow_unicode=True)


def check_avatars(upload: Upload, listing: list[dict], url: str) -> None:
    """Every avatar the job names is resident on the server (else: the ones it has), one frame size."""
    have = {a["name"]: a for a in listing}
    for name in upload.avatars:
        if name not in have:
            named = " (with --server an avatar is named, not a folder)" if "/" in name or "\\" in name else ""
            listed = f"it has: {', '.join(sorted(have))}" if have else "it has no avatars"
            raise InputError(name, f"unknown avatar: not on the server at {url} ({listed}){named}")
    sizes = {(have[n]["width"], have[n]["height"]) for n in upload.avatars}
    if len(sizes) > 1:
        listed = ", ".join(f"{n} {have[n]['width']}x{have[n]['height']}" for n in upload.avatars)
        raise InputError(upload.source or upload.avatars[0],
                         f"all avatars of one video must have the same frame size ({listed})")
    if upload.program is not None:  # the show against the server's frame size, before anything is uploaded
        from lipstream.show.checks import check_show, declared_durations, frame_size_of

        program = upload.program
        check_show(program, frame_size_of([have[n] for n in upload.avatars]),
                   declared_durations(program) if program.show.visual() else None)


@dataclass
class JobServer:
    """A running `lipstream serve` as its jobs API sees it: one HTTP client with the bearer key, every
    answer that is not the one asked for turned into a one-line RemoteError naming the server."""

    url: str
    api_key: str | None = None
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
            if not self.api_key:
                return RemoteError(f"the server at {self.url} needs an API key ({status}): set LIPSTREAM_API_KEY "
                                   "or pass --api-key")
            return RemoteError(f"the server at {self.url} refused the API key ({status}): {detail}")
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
