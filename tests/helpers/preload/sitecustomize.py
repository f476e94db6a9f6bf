"""Client side of the preloaded launcher (tests/helpers/preloaded.py); test environment only.

Python imports ``sitecustomize`` at start-up from anywhere on ``sys.path``, so a launch test that
puts this folder on ``PYTHONPATH`` (``preloaded.launch_env``) reaches every Python process its
command starts: ``run_pretrain.sh``'s tools, torchrun and torchrun's ranks. Such a process, when
``LOCO_PRELOAD_SOCKET`` names a running server of the same interpreter and ``PYTHONPATH``,
hands its command line, environment, working directory and standard streams to that server,
which forks a child that already has torch, megatron-core and ``megatron.training`` imported;
this process then stands in for the child: it forwards the signals it gets (torchrun's SIGTERM,
Slurm-style SIGUSR1) and exits as the child did (its code, or the same signal). If this
process dies (SIGKILL), the child sees its end of a pipe close and kills itself.

Anything else (another interpreter or path, an option other than ``-u``/``-B``, a Slurm job,
multiprocessing's spawned helpers, which read file descriptors they inherit) starts normally.
Only the standard library is imported here.
"""

import os
import sys


def _command(argv):
    """``(unbuffered, kind, target, rest)`` for ``python [-u] [-B] (-m mod | -c code | file)
    args``, or None for anything else (the process then starts normally)."""
    unbuffered, i = bool(os.environ.get("PYTHONUNBUFFERED")), 1
    while i < len(argv) and argv[i] in ("-u", "-B"):
        unbuffered |= argv[i] == "-u"
        i += 1
    if i >= len(argv):
        return None
    if argv[i] in ("-m", "-c") and i + 1 < len(argv):
        if argv[i] == "-c" and "multiprocessing" in argv[i + 1]:
            return None  # multiprocessing's spawn / forkserver / resource tracker
        return unbuffered, argv[i], argv[i + 1], argv[i + 2:]
    if argv[i].startswith("-"):
        return None
    return unbuffered, "file", argv[i], argv[i + 1:]


def _delegate(path):
    import json
    import signal
    import socket

    command = _command(sys.orig_argv)
    if (command is None or "SLURM_JOB_ID" in os.environ  # Slurm tracks a job's own processes
            or os.environ.get("LOCO_PRELOAD_EXECUTABLE") != sys.executable
            or os.environ.get("LOCO_PRELOAD_PYTHONPATH") != os.environ.get("PYTHONPATH")):
        return
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        return  # no server (any more): start normally
    alive_r, alive_w = os.pipe()
    request = dict(zip(("unbuffered", "kind", "target", "args"), command),
                   argv=sys.orig_argv, cwd=os.getcwd(), env=dict(os.environ))
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2, alive_r])
    os.close(alive_r)
    reader = conn.makefile("r")
    pid = int(reader.readline())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2):
        signal.signal(sig, lambda s, _frame: os.kill(pid, s))
    line = reader.readline()  # "exit N" or "signal N", once the child is gone
    if not line:
        sys.stderr.write("preloaded launcher: the server closed without an exit status\n")
        os._exit(1)
    how, value = line.split()
    sys.stdout.flush()
    if how == "signal":
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    os._exit(int(value))


if os.environ.get("LOCO_PRELOAD_SOCKET"):
    _delegate(os.environ["LOCO_PRELOAD_SOCKET"])
