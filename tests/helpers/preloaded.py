"""The preloaded launcher: launch tests' Python processes forked from one that has torch,
megatron-core and ``megatron.training`` imported already (test environment only).

Every ``run_pretrain.sh``/torchrun launch starts several Python processes (the preflight and
schedule tools, torchrun, one per rank), and each one imports torch and megatron: about 10 s of
CPU per rank before the first iteration. The launch tests instead run their commands with
:func:`launch_env`: ``PYTHONPATH`` starts with ``tests/helpers/preload``, whose
``sitecustomize`` hands each matching process's command to this module's server
(``python -m tests.helpers.preloaded SOCKET``, started once per test session). The server forks
a child per command; the child takes the caller's standard streams, working directory,
environment and ``sys.argv``/``sys.path`` as a fresh ``python`` would set them, then runs the
module, script or ``-c`` code as ``__main__`` and exits as the interpreter would (non-daemon
threads joined, ``atexit`` run). The commands themselves are unchanged: the same script, the
same torchrun, the same ranks; only the imports of :data:`PRELOAD` are done once.
``tests/helpers/multiproc.py`` does the same for ``run_ranks`` with Python's forkserver.

``LOCO_TEST_PRELOAD=0`` turns it off (every process imports for itself, as before).
"""

import atexit
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parents[2]
SHIM_DIR = Path(__file__).resolve().parent / "preload"
#: what the server imports once (a training rank of run_pretrain.sh imports all of these)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.run", "numpy",
           "megatron.core", "megatron.core.distributed", "megatron.core.optimizer",
           "megatron.core.models.gpt.gpt_model", "megatron.core.dist_checkpointing",
           "megatron.core.datasets.gpt_dataset", "megatron.training",
           "megatron.training.training", "megatron.training.arguments",
           "megatron.training.initialize", "megatron.training.checkpointing",
           "torch.utils.tensorboard", "tokenizers", "transformers"]


# ---------------------------------------------------------------------------- client side
_server: Dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get("LOCO_TEST_PRELOAD", "1") != "0"


def _start() -> Optional[str]:
    """The running server's socket path (started on first use; stopped at exit)."""
    if "path" in _server:
        return _server["path"]
    tmp = tempfile.mkdtemp(prefix="loco-preload-")
    path = os.path.join(tmp, "server.sock")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get(
        "OMP_NUM_THREADS", "1"))
    env.pop("LOCO_PRELOAD_SOCKET", None)
    log = open(os.path.join(tmp, "server.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.preloaded", path], cwd=ROOT,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log, text=True)
    ready = proc.stdout.readline().strip()
    if ready != "ready":
        proc.kill()
        log.close()
        raise RuntimeError(f"preloaded launcher did not start (said {ready!r}): "
                           f"{Path(log.name).read_text()[-3000:]}")

    def stop():
        proc.stdin.close()  # the server exits on end of input
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

    atexit.register(stop)
    _server.update(path=path, proc=proc)
    return path


def launch_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's environment) for a launch command whose Python
    processes come from the preloaded server: ``PYTHONPATH`` = the shim folder then the
    repository root (as the launch helpers set it), and the server's socket. Unchanged when
    :func:`enabled` is false."""
    env = dict(os.environ if env is None else env)
    pythonpath = f"{SHIM_DIR}{os.pathsep}{ROOT}"
    if not enabled():
        env["PYTHONPATH"] = str(ROOT)
        return env
    env.update(PYTHONPATH=pythonpath, LOCO_PRELOAD_SOCKET=_start(),
               LOCO_PRELOAD_EXECUTABLE=sys.executable, LOCO_PRELOAD_PYTHONPATH=pythonpath)
    return env


# ---------------------------------------------------------------------------- server side
def _reset_python_state(request):
    """In the forked child: what a fresh ``python ARGV`` would have (process-wide state)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    kind, target = request["kind"], request["target"]
    first = {"-m": os.getcwd(), "-c": "", "file": os.path.dirname(os.path.abspath(target))}[kind]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_BASE_PATH]
    sys.argv = [{"-m": target, "-c": "-c", "file": target}[kind], *request["args"]]
    sys.orig_argv = list(request["argv"])
    unbuffered = request["unbuffered"]
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  line_buffering=not unbuffered and os.isatty(1),
                                  write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True,
                                  write_through=unbuffered)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


def _watch_caller(alive_fd):
    """Kill this child when its caller (the stand-in process) is gone."""
    def watch():
        while os.read(alive_fd, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="preload-caller-watch", daemon=True).start()


def _run(request) -> int:
    """Run the request's module / code / file as ``__main__``; the interpreter's exit code."""
    import runpy
    import types

    kind, target = request["kind"], request["target"]
    try:
        if kind == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "file":
            runpy.run_path(target, run_name="__main__")
        else:
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        kind_, value, tb = sys.exc_info()
        sys.excepthook(kind_, value, tb.tb_next)  # from the user's code on, as python prints it
        code = 1
    try:
        threading._shutdown()  # the interpreter joins non-daemon threads before atexit
    except Exception:
        pass
    import atexit as _atexit

    _atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def _child(request, fds, own_fds):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in own_fds:
        os.close(fd)
    os.setsid()
    for target, fd in zip((0, 1, 2), fds[:3]):
        os.dup2(fd, target)
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)
    _watch_caller(fds[3])
    _reset_python_state(request)
    os._exit(_run(request))


def serve(path: str):
    """Preload, then fork one child per request on ``path`` until standard input closes."""
    import importlib

    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    global _BASE_PATH  # sys.path = [the -m directory, *PYTHONPATH, *what every process has]
    _BASE_PATH = sys.path[1 + len([p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]):]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: Dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([listener, wake_r, sys.stdin], [], [])
        if sys.stdin in ready and not sys.stdin.readline():
            break
        if wake_r in ready:
            os.read(wake_r, 4096)
        if listener in ready:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
            while not data.endswith(b"\n"):
                data += conn.recv(1 << 20)
            request = json.loads(data)
            own_fds = [listener.fileno(), wake_r, wake_w, conn.fileno(),
                       *(c.fileno() for c in children.values())]
            pid = os.fork()
            if pid == 0:
                _child(request, fds, own_fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exit {os.waitstatus_to_exitcode(status)}")
            try:
                conn.sendall(f"{how}\n".encode())
            except OSError:
                pass  # the caller is gone
            conn.close()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_BASE_PATH = []

if __name__ == "__main__":
    serve(sys.argv[1])
