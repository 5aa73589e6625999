"""Run untrusted Python in a bubblewrap sandbox (the ``code`` task's grader, ``data/tasks/code.py``).

A completion's program runs in ``bwrap`` (bubblewrap, from the distribution's packages) with:

- **no network** and no other namespace shared (``--unshare-all``: net, pid, ipc, uts, cgroup, user);
- **a read-only root** made of the interpreter and the system's libraries only (``/usr`` and, when the
  interpreter lives elsewhere, its installation prefix, both bound read-only): no ``/etc``, no ``/home``,
  no run directory, nothing of the learner's;
- **a private tmp**: ``/tmp`` a fresh tmpfs of ``tmp_mb`` (the only writable place), the working
  directory; a fresh ``/proc`` and minimal ``/dev``;
- **limits** set by util-linux's ``prlimit`` before ``bwrap`` starts (inherited, never raised inside; no
  Python runs between fork and exec, which could deadlock a learner grading on several threads):
  CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``), open files, no
  core dumps; processes (``RLIMIT_NPROC``) set inside the sandbox by util-linux's ``prlimit`` just before
  the program, so it counts the sandbox's own user namespace only (set before bwrap, the kernel would
  also hold every sandbox of the same user, and a non-root learner's own threads, to it: measured, a fork
  bomb's dying processes then failed the next sandbox's start); a wall-clock limit and an output cap
  enforced from outside (the whole sandbox is killed: bwrap's ``--die-with-parent`` and the pid namespace
  take every process it started with it);
- a CPU priority below the learner's (coreutils' ``nice`` 10: an update keeps its cores while a batch is
  graded);
- an empty environment (``--clearenv``), a session of its own (``--new-session``: no terminal to write
  to), no capabilities, no further user namespaces (``--disable-userns``).

A root learner starts the whole chain as an unprivileged user (``nobody``, switched by ``subprocess``
before exec): a sandbox started by root ignores
``RLIMIT_NPROC`` (measured: 200 forks under a limit of 16, set outside or inside, with or without a uid
switched inside); started as ``nobody`` the limit holds. Any other user runs bwrap as
itself (unprivileged user namespaces must be allowed, as on most distributions).

The interpreter is ``/usr/bin/python3`` where there is one (readable by any user), else the learner's
own base interpreter (never its virtual environment: no site-packages of the run's), or the one named;
it runs with ``-I -S`` (isolated, no site).

:meth:`Sandbox.run` never raises on what the program does: it returns an :class:`Outcome` with a status
(``ok``, ``exit`` (non-zero), ``timeout``, ``cpu``, ``memory``, ``output``, ``killed``) and the last
``keep_bytes`` of the output. A machine without bubblewrap (or where it cannot make namespaces) fails at
:func:`probe` with one line saying what to install; nothing runs unsandboxed.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from echo2.errors import ConfigError

NOBODY = 65534  # the uid a root learner's sandbox runs as
Status = Literal["ok", "exit", "timeout", "cpu", "memory", "output", "killed"]


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    wall_s: float = 10.0  # wall-clock seconds, then the sandbox is killed
    cpu_s: int = 5  # CPU seconds of each process (RLIMIT_CPU: SIGXCPU, then SIGKILL)
    memory_mb: int = 512  # address space of each process (RLIMIT_AS)
    processes: int = 16  # processes and threads in the sandbox (RLIMIT_NPROC)
    output_bytes: int = 1 << 20  # stdout + stderr read, then the sandbox is killed
    tmp_mb: int = 64  # the size of the private /tmp
    file_mb: int = 16  # the largest file a process may write (RLIMIT_FSIZE)
    open_files: int = 64  # RLIMIT_NOFILE
    nice: int = 10  # CPU priority below the learner's (an update keeps its cores while a batch is graded)

    def __post_init__(self) -> None:
        for name in (
            "wall_s",
            "cpu_s",
            "memory_mb",
            "processes",
            "output_bytes",
            "tmp_mb",
            "file_mb",
            "open_files",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"sandbox limit {name} = {getattr(self, name)!r} must be > 0")
        if not 0 <= self.nice <= 19:
            raise ConfigError(f"sandbox nice = {self.nice!r} must be in 0..19")


@dataclass(frozen=True)
class Outcome:
    """What one sandboxed run did."""

    status: Status  # ok: exited 0; exit: another code; the rest: a limit it hit, or a signal
    exit_code: int | None  # the process's exit status (negative: killed by that signal), None if we killed it
    wall_s: float
    output: bytes  # the last ``keep_bytes`` of stdout and stderr together


class SandboxUnavailable(ConfigError):
    """bubblewrap is missing or cannot make its namespaces here."""


SYSTEM_PYTHON = Path("/usr/bin/python3")


def interpreter(python: str | None = None) -> tuple[str, list[str]]:
    """The Python the sandbox runs (module docstring) and the read-only binds it needs beyond ``/usr``
    (the installation prefix of one that lives elsewhere: ``<prefix>/bin/python``)."""
    if python:
        exe = Path(python).resolve()
        if not exe.is_file():
            raise ConfigError(f"sandbox python {python!r}: no such file")
        prefix = exe.parent.parent
    elif SYSTEM_PYTHON.exists():
        exe, prefix = SYSTEM_PYTHON.resolve(), Path("/usr")
    else:
        exe = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
        prefix = Path(sys.base_prefix).resolve()
    binds = [] if prefix == Path("/usr") or Path("/usr") in prefix.parents else [str(prefix)]
    return str(exe), binds


class Sandbox:
    """bubblewrap with :class:`Limits`; one :meth:`run` per program (any thread)."""

    def __init__(
        self,
        limits: Limits = Limits(),
        *,
        keep_bytes: int = 4096,
        bwrap: str | None = None,
        python: str | None = None,
    ) -> None:
        self.limits = limits
        self.keep_bytes = keep_bytes
        self.python, self.binds = interpreter(python)
        found = bwrap or shutil.which("bwrap")
        if found is None:
            raise SandboxUnavailable(
                "the code task runs completions in bubblewrap, which is not installed: install the "
                "distribution's 'bubblewrap' package (apt-get install bubblewrap)"
            )
        self.bwrap = found
        self.prlimit = shutil.which("prlimit", path="/usr/bin:/bin")
        self.nice = shutil.which("nice", path="/usr/bin:/bin") or "nice"
        if self.prlimit is None:
            raise SandboxUnavailable(
                "the sandbox needs util-linux's prlimit in /usr/bin (apt-get install util-linux)"
            )

    def argv(self, args: list[str]) -> list[str]:
        """The ``bwrap`` command line that runs ``args`` (the sandbox's own program) under these limits."""
        lim = self.limits
        cmd = [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/tmp",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        for link in ("bin", "lib", "lib64", "sbin"):  # merged-/usr systems: links; older ones: directories
            path = Path("/") / link
            if path.is_symlink():
                cmd += ["--symlink", os.readlink(path), f"/{link}"]
            elif path.is_dir():
                cmd += ["--ro-bind", str(path), f"/{link}"]
        for bind in self.binds:
            cmd += ["--ro-bind", bind, bind]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp"]
        cmd += ["--chdir", "/tmp", "--cap-drop", "ALL", "--disable-userns", "--unshare-user"]
        return [*cmd, "--", self.prlimit, f"--nproc={lim.processes}:{lim.processes}", "--", *args]

    def outer(self) -> list[str]:
        """What runs bwrap: util-linux's ``prlimit`` with the per-process limits (inherited by everything
        it starts) and coreutils' ``nice``. Tools exec'd in the child, not a ``preexec_fn``: the learner
        grades on several threads, and Python code between fork and exec may deadlock there."""
        lim = self.limits
        return [
            self.prlimit,
            f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}",
            f"--as={lim.memory_mb << 20}",
            f"--fsize={lim.file_mb << 20}",
            f"--nofile={lim.open_files}",
            "--core=0",
            "--",
            self.nice, "-n", str(lim.nice),
        ]  # fmt: skip

    def run(self, args: list[str], stdin: bytes = b"") -> Outcome:
        """Run ``args`` in the sandbox with ``stdin``; never raises on what it does (module docstring)."""
        lim = self.limits
        t0 = time.monotonic()
        root = os.geteuid() == 0  # then bwrap starts as nobody (module docstring)
        proc = subprocess.Popen(
            [*self.outer(), *self.argv(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **({"user": NOBODY, "group": NOBODY, "extra_groups": []} if root else {}),  # type: ignore[arg-type]
        )
        assert proc.stdin is not None and proc.stdout is not None
        kept, read, status = bytearray(), 0, None
        pending = memoryview(stdin)
        sel = selectors.DefaultSelector()
        try:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if pending:  # written as the program reads it: a program that never reads cannot block us
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
            while True:
                left = lim.wall_s - (time.monotonic() - t0)
                if left <= 0:
                    status = "timeout"
                    break
                done = False
                for key, _ in sel.select(min(left, 0.5)):
                    if key.fileobj is proc.stdin:
                        pending = _write_some(proc, pending)
                        if not pending:
                            sel.unregister(proc.stdin)
                            proc.stdin.close()
                        continue
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    if not chunk:
                        done = True
                        break
                    read += len(chunk)
                    kept = (kept + chunk)[-self.keep_bytes :]
                    if read > lim.output_bytes:
                        status = "output"
                        done = True
                        break
                if done:
                    break
        finally:
            sel.close()
            if status is not None:
                _kill(proc)
            try:
                code = proc.wait(timeout=max(0.1, lim.wall_s - (time.monotonic() - t0)) + 1.0)
            except subprocess.TimeoutExpired:  # its output closed but it runs on (a daemonised child)
                _kill(proc)
                code, status = proc.wait(), status or "timeout"
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
        wall = time.monotonic() - t0
        if status is not None:
            return Outcome(status, None, wall, bytes(kept))
        return Outcome(_status(code, bytes(kept)), code, wall, bytes(kept))


def _write_some(proc: subprocess.Popen[bytes], pending: memoryview) -> memoryview:
    """Write what the program's stdin takes now; what is left (nothing once it closed its stdin)."""
    assert proc.stdin is not None
    try:
        return pending[os.write(proc.stdin.fileno(), pending[:65536]) :]
    except BlockingIOError:
        return pending
    except OSError:  # it exited or closed its stdin: the rest is not ours to deliver
        return pending[:0]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill bwrap's whole session (its pid namespace dies with its first process)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _status(code: int, output: bytes) -> Status:
    """The status of an exit code (bwrap passes its program's on: 128 + N for signal N)."""
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    if code == 0:
        return "ok"
    if signum == signal.SIGXCPU:
        return "cpu"
    if b"MemoryError" in output[-512:]:
        return "memory"
    return "killed" if signum else "exit"


def probe(sandbox: Sandbox) -> None:
    """Fail with one line unless the sandbox can run a program here (bubblewrap present, namespaces
    allowed): called when a run that needs it starts, not at its first grade."""
    got = sandbox.run([sandbox.python, "-I", "-c", "print('ok')"])
    if got.status != "ok" or got.output.strip() != b"ok":
        text = got.output.decode(errors="replace").strip().splitlines()
        raise SandboxUnavailable(
            f"bubblewrap ({sandbox.bwrap}) cannot run a program here ({got.status}, exit {got.exit_code}: "
            f"{text[-1] if text else 'no output'}); it needs user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, or run as root)"
        )
