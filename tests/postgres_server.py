"""A throwaway PostgreSQL server for tests: Debian's binaries, a temporary data folder, a unix
socket only (no TCP port), fsync off; started once, stopped (and deleted) at the end.

PostgreSQL refuses to run as root: as root it runs as the `postgres` system user (Debian's
package creates it; else `nobody`) through runuser, in a folder that user owns."""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

PACKAGE_HINT = "Debian's postgresql package (make postgres installs it as root)"


def find_bin_dir() -> Path | None:
    """The folder of initdb and pg_ctl: PATH first, then /usr/lib/postgresql/<newest>/bin."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(os.path.realpath(initdb)).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def missing_reason() -> str | None:
    """Why no server can be started here, or None."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        return f"no initdb/pg_ctl on PATH or under /usr/lib/postgresql: install {PACKAGE_HINT}"
    if os.geteuid() == 0 and _server_user() is None:
        return "running as root and neither a postgres nor a nobody user to run PostgreSQL as"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser to run PostgreSQL as another user"
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    return None


class PostgresServer:
    def __init__(self) -> None:
        self.bin_dir = find_bin_dir()
        self.folder = Path(tempfile.mkdtemp(prefix="lipstream-pg-"))  # short: a socket path has a limit
        self.data = self.folder / "data"
        self.user = _server_user() if os.geteuid() == 0 else None
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)

    def start(self) -> PostgresServer:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "log"), "-w", "-t", "60", "-o",
                  f"-k {self.folder} -c listen_addresses='' -c fsync=off -c synchronous_commit=off "
                  "-c full_page_writes=off", "start")
        return self

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@/{database}?host={self.folder}"

    def new_database(self) -> str:
        """A fresh empty database's URL (each test its own)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        import psycopg

        name = url.split("@/", 1)[1].split("?", 1)[0]
        with psycopg.connect(self.url(), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def _run(self, program: str, *args: str) -> None:
        command = [str(self.bin_dir / program), *args]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, cwd=self.folder, timeout=120)
        if done.returncode != 0:
            log = (self.folder / "log").read_text(errors="replace")[-2000:] if (self.folder / "log").exists() else ""
            raise RuntimeError(f"{program} failed ({done.returncode}): {done.stderr.strip()} {log}")


def _server_user() -> str | None:
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    return None
