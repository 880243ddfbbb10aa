"""New processes for ``python -m glassloop ...`` and ``python script.py ...`` without paying
torch's import each time: a server process imports torch (and ``torch._dynamo``, which the
first optimizer imports) and glassloop's command once, then forks one child per command.

Each child is a new process: its own pid, real signals (a ``kill -9`` is a SIGKILL), its own
exit status, the ``cwd`` and environment it is given, and nothing of an earlier run in its
memory (the server never trains). What it shares with its siblings is the imports; so that
the ones a test compares (a run, then its resume) do not share a hash seed either, two
servers with different ``PYTHONHASHSEED`` take turns. A subprocess costs ~4 s of CPU, ~3.5 s
of it imports (torch ~1.5 s, ``torch._dynamo`` ~1.2 s, matplotlib for the report) and ~0.9 s
of its exit a collection over them; a forked command ~0.3 s in all. Tests that need what a
fresh interpreter does before it runs anything (the first line a terminal sees before torch
is imported, an import's side effects, a process's exit with its loader workers) and
torchrun's workers still start real ones.

    done = run([sys.executable, "-m", "glassloop", "train", "cfg.toml"], cwd=tmp, timeout=300)
    proc = Popen([sys.executable, "kill.py", "train", ...], cwd=tmp, env=env)
"""

from __future__ import annotations

import itertools
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import IO, Any

# The server: imports, then one fork per request. A child leaves the loop by running the
# command as `python -m` / `python script.py` would, and ends as that interpreter would
# (SystemExit's code, or a traceback and 1), its atexit handlers and threads included.
SERVER = r"""
import os, select, signal, socket, sys
channel = socket.socket(fileno=int(sys.argv[1]))
import torch, torch._dynamo, numpy
import glassloop.cli.main, glassloop.config.assemble, glassloop.loop, glassloop.tracking.launched
try:
    import matplotlib.figure, matplotlib.backends.backend_agg
except ImportError:
    pass
import faulthandler, gc, json, resource, runpy, tempfile, time
gc.freeze()  # the imports' objects: no collection walks them again (a child's exit: 0.9 -> 0.1 s)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)

def send(message):
    channel.send(json.dumps(message).encode())

def run(request, fds):
    channel.close()
    os.close(wake_r)
    os.close(wake_w)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request["fsize"] is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], request["fsize"]))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    tempfile.tempdir = None  # (found again from this environment's TMPDIR when first asked)
    numpy.random.seed()  # (the legacy global RNG from fresh entropy, as a new interpreter)
    glassloop.tracking.launched.LAUNCHED = time.perf_counter()  # ("since launch": from here)
    args = request["args"]
    if args[0] == "-m":  # sys.path[0] the folder, sys.argv[0] the module's file (runpy's)
        sys.path[0], sys.argv = os.getcwd(), ["-m", *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:  # sys.path[0] the script's folder
        sys.path[0], sys.argv = os.path.dirname(os.path.abspath(args[0])), list(args)
        runpy.run_path(args[0], run_name="__main__")
    sys.exit(0)

running = {}  # pid: in a session of its own
while True:
    ready, _, _ = select.select([channel, wake_r], [], [])
    if wake_r in ready:
        os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            running.pop(pid, None)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
    if channel in ready:
        message, fds, _, _ = socket.recv_fds(channel, 1 << 20, 3)
        if not message:  # the test process is gone: nothing it started keeps running
            for pid, session in running.items():
                try:
                    (os.killpg if session else os.kill)(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            run(request, fds)
        running[pid] = request["new_session"]
        for fd in fds:
            os.close(fd)
        send({"pid": pid})
"""


# Read as an interpreter starts (Python's flags, its locale) or as torch loads its libraries
# (OpenMP's threads): a child has its server's, so a command given other values needs a real
# process (ValueError says so). Others (what a library set in this process, say) reach the
# child as they would a new interpreter: its os.environ is the one given, and TMPDIR is read
# again (tempfile keeps the folder it found first).
AT_START = ("PYTHON", "OMP_", "MKL_", "LD_", "LANG", "LC_")


class Server:
    """One server process and the exit codes it has reported."""

    def __init__(self, hash_seed: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.channel = ours
        self.exits: dict[int, int] = {}

    def check(self, env: dict[str, str]) -> None:
        read_at_start = {k for k in {*env, *self.env} if k.startswith(AT_START)}
        read_at_start -= {"PYTHONFAULTHANDLER", "PYTHONHASHSEED"}  # (set here, each its own)
        differ = sorted(k for k in read_at_start if env.get(k) != self.env.get(k))
        if differ or "PYTHONHASHSEED" in env:
            raise ValueError(f"forkserver: {differ} differ from the server's: use subprocess")

    def start(
        self, args: list[str], cwd: Path, env: dict[str, str], fds: list[int], **how: Any
    ) -> int:
        request = {"args": args, "cwd": str(cwd), "env": env, **how}
        socket.send_fds(self.channel, [json.dumps(request).encode()], fds)
        while True:  # (exit reports of earlier children may come first)
            message = self.receive(timeout=None)
            assert message is not None
            if "pid" in message:
                return int(message["pid"])

    def receive(self, timeout: float | None) -> dict[str, int] | None:
        self.channel.settimeout(timeout)
        try:
            data = self.channel.recv(1 << 16)
        except TimeoutError:
            return None
        if not data:
            raise RuntimeError("the fork server died")
        message = json.loads(data)
        if "exit" in message:
            self.exits[message["exit"]] = message["code"]
        return message  # type: ignore[no-any-return]

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.exits:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self.receive(left)
        return self.exits.pop(pid)


_servers: list[Server] = []
_turn = itertools.count()


def server() -> Server:
    """The next of the two servers (started on first use, one pair per test process)."""
    if not _servers:
        _servers.extend(Server(hash_seed) for hash_seed in (1, 2))
    return _servers[next(_turn) % 2]


class Popen:
    """The part of :class:`subprocess.Popen` the tests use, for a forked child: ``pid``,
    ``stdout``/``stderr`` (pipes), ``poll``, ``wait``, ``send_signal``, ``kill``,
    ``communicate`` and ``returncode`` (negative: the signal that ended it)."""

    def __init__(
        self,
        args: list[str],
        *,
        cwd: Path | str | None = None,
        env: dict[str, str] | None = None,
        stdout: int | None = subprocess.PIPE,
        stderr: int | None = subprocess.PIPE,
        text: bool = True,
        start_new_session: bool = False,
        fsize_limit: int | None = None,
    ) -> None:
        if args[0] != sys.executable or args[1:2] == ["-c"] or len(args) < 2:
            raise ValueError(f"forkserver runs `python -m module ...` or a script: {args}")
        self.args = args
        self.returncode: int | None = None
        self.text = text
        self.server = server()
        environment = dict(os.environ if env is None else env)
        self.server.check(environment)
        devnull = os.open(os.devnull, os.O_RDWR)
        ends, ours = [devnull], []
        for wanted in (stdout, stderr):
            if wanted == subprocess.PIPE:
                r, w = os.pipe()
                ends.append(w)
                ours.append(os.fdopen(r, "r" if text else "rb"))
            elif wanted == subprocess.DEVNULL:
                ends.append(devnull)
                ours.append(None)
            else:
                raise ValueError("stdout/stderr: PIPE or DEVNULL")
        self.stdout: IO[Any] | None = ours[0]
        self.stderr: IO[Any] | None = ours[1]
        self.pid = self.server.start(
            args[1:],
            Path(cwd or os.getcwd()),
            environment,
            ends,
            new_session=start_new_session,
            fsize=fsize_limit,
        )
        for fd in set(ends):
            os.close(fd)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (never a pid that was reaped and may be reused)
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Both pipes read to their end, then the exit code; ``TimeoutExpired`` as
        :meth:`subprocess.Popen.communicate` (the child left running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[Any, list[bytes]] = {}
        with selectors.DefaultSelector() as selector:
            for stream in (self.stdout, self.stderr):
                if stream is not None and not stream.closed:
                    selector.register(stream.fileno(), selectors.EVENT_READ, stream)
                    chunks[stream] = []
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.data].append(data)
                    else:
                        selector.unregister(key.fd)
        outputs = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                outputs.append(None)
                continue
            data = b"".join(chunks.get(stream, []))
            stream.close()
            outputs.append(data.decode(errors="replace") if self.text else data)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        return outputs[0], outputs[1]


def run(
    args: list[str],
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float,
    start_new_session: bool = True,
    fsize_limit: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout)`` in a forked
    child (its own session: on a timeout it is killed with everything it started, then
    ``TimeoutExpired`` is raised, as :func:`cli_runner.run_group` does)."""
    proc = Popen(
        args, cwd=cwd, env=env, start_new_session=start_new_session, fsize_limit=fsize_limit
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if start_new_session:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode or 0, out, err)


def start_children_here(monkeypatch: Any, module: ModuleType) -> None:
    """The ``python -m glassloop ...`` children that ``module`` starts with
    ``subprocess.Popen`` (verify-resume's three training runs) forked here instead: for tests
    of what such a command finds, not of how it starts its children (tests/tools/
    test_verify_resume*.py start real ones). ``preexec_fn`` (a parent-death signal) is left
    out: a forked child's parent is its server."""

    def popen(args: list[str], *, stdout: int, stderr: int, text: bool, **_: Any) -> Popen:
        return Popen(list(args), stdout=stdout, stderr=stderr, text=text)

    started = SimpleNamespace(
        Popen=popen, PIPE=subprocess.PIPE, CompletedProcess=subprocess.CompletedProcess
    )
    monkeypatch.setattr(module, "subprocess", started)
