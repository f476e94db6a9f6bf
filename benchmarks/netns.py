"""Two emulated "nodes": Linux network namespaces joined by a rate-limited veth pair.

    with TwoNodeLink(rate="1gbit") as link:
        link.exec_prefix(0) + ["python", ...]   # runs inside namespace 0 (address link.addr[0])
        link.set_rate("10gbit")                  # tc qdisc replace on both veth ends
        link.measure_rate()                      # bytes/s of one TCP stream ns0 -> ns1

Everything is named after this process id (``loco-bench-<pid>-0/1``, veth ``lb<pid>a/b``,
subnet ``10.213.<pid % 250>.0/24``), so concurrent runs do not collide and the addresses exist
only inside the namespaces created here: no traffic reaches the host's interfaces. Deleting a
namespace deletes its veth end (and so the pair and the qdiscs); :meth:`TwoNodeLink.close` kills
the processes it started, then deletes both namespaces; it runs on ``with`` exit, on
``atexit`` and on SIGTERM, and also sweeps namespaces left behind by dead benchmark processes.
Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable` says why not, without raising.
"""

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from typing import Dict, List, Optional

PREFIX = "loco-bench-"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str:
    """Why the two-namespace link cannot be built here ("" when it can)."""
    if sys.platform != "linux":
        return f"needs Linux network namespaces (platform {sys.platform})"
    if os.geteuid() != 0:
        return "needs root (ip netns / tc); run as root to measure over the emulated link"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    return ""


def namespaces() -> List[str]:
    """Names of the network namespaces that exist now."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep_stale() -> List[str]:
    """Delete ``loco-bench-<pid>-*`` namespaces whose creating process is gone (killed with
    SIGKILL, so its cleanup never ran), and the processes still inside; returns their names."""
    gone = []
    for ns in namespaces():
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", ns)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            _delete(ns)
            gone.append(ns)
    return gone


def _delete(ns: str) -> None:
    """SIGKILL every process left inside namespace ``ns`` (they would outlive it), delete it."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)


def _tbf(rate: str, burst_s: float = 0.004) -> List[str]:
    """tbf arguments for ``rate`` (tc syntax: 100mbit, 1gbit, ...): burst = 4 ms of traffic."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. 100mbit, 1gbit, 10gbit")
    bits = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
    burst = max(int(bits / 8 * burst_s), 64 * 1024)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


class TwoNodeLink:
    """Two network namespaces joined by one veth pair, each end shaped by ``tc tbf``.

    Args:
        rate: tc rate on each veth end (each direction), e.g. ``"1gbit"``.
        tag: distinguishes several links of one process (0..9).
    """

    def __init__(self, rate: str, tag: int = 0):
        pid = os.getpid()
        self.ns = [f"{PREFIX}{pid}-{2 * tag}", f"{PREFIX}{pid}-{2 * tag + 1}"]
        self.dev = [f"lb{pid}{tag}a"[:15], f"lb{pid}{tag}b"[:15]]
        net = f"10.213.{(pid * 10 + tag) % 250}"
        self.addr = [f"{net}.1", f"{net}.2"]
        self.rate = rate
        self.procs: List[subprocess.Popen] = []
        self._open = False
        self._old_term = None

    # -- set-up / tear-down ------------------------------------------------------------------
    def __enter__(self) -> "TwoNodeLink":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Create namespaces, veth pair, addresses, ``lo`` and the qdiscs; undone on failure."""
        sweep_stale()
        atexit.register(self.close)
        self._open = True
        if hasattr(signal, "SIGTERM") and _main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.dev[0], "netns", self.ns[0], "type", "veth",
                "peer", "name", self.dev[1], "netns", self.ns[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            self.set_rate(self.rate, replace=False)
        except BaseException:
            self.close()
            raise

    def set_rate(self, rate: str, replace: bool = True) -> None:
        """Shape both veth ends to ``rate`` (tc tbf, root qdisc)."""
        for ns, dev in zip(self.ns, self.dev):
            _ip("netns", "exec", ns, "tc", "qdisc", "replace" if replace else "add", "dev", dev,
                "root", *_tbf(rate))
        self.rate = rate

    def close(self) -> None:
        """Kill the processes started through :meth:`popen`, delete both namespaces. Idempotent."""
        if not self._open:
            return
        self._open = False
        for p in self.procs:
            kill_group(p)
        self.procs.clear()
        for ns in self.ns:  # also whatever else was started inside (it would keep running)
            _delete(ns)
        if self._old_term is not None and _main_thread():
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        atexit.unregister(self.close)

    # -- running things inside ---------------------------------------------------------------
    def exec_prefix(self, node: int) -> List[str]:
        """Command prefix that runs a program inside namespace ``node`` (0 or 1)."""
        return ["ip", "netns", "exec", self.ns[node]]

    def popen(self, node: int, cmd: List[str], env: Optional[Dict[str, str]] = None,
              **kw) -> subprocess.Popen:
        """Start ``cmd`` in namespace ``node`` in its own process group (killed by close)."""
        p = subprocess.Popen(self.exec_prefix(node) + cmd, env=env, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def tx_bytes(self, node: int) -> int:
        """Bytes sent so far by ``node``'s veth end (kernel counter)."""
        path = f"/sys/class/net/{self.dev[node]}/statistics/tx_bytes"
        out = subprocess.run(self.exec_prefix(node) + ["cat", path], capture_output=True,
                             text=True, check=True, timeout=30).stdout
        return int(out)

    def measure_rate(self, nbytes: int = 16 * 2 ** 20, port: int = 29400) -> float:
        """Bytes/s of one TCP stream of ``nbytes`` from namespace 0 to namespace 1.

        Timed by the receiver from its first to its last byte (so start-up is excluded).
        """
        server = self.popen(1, [sys.executable, "-c", _SERVER, self.addr[1], str(port),
                                str(nbytes)], stdout=subprocess.PIPE, text=True)
        client = self.popen(0, [sys.executable, "-c", _CLIENT, self.addr[1], str(port),
                                str(nbytes)])
        try:
            out, _ = server.communicate(timeout=120)
            client.wait(timeout=30)
        finally:
            for p in (server, client):
                kill_group(p)
                if p in self.procs:
                    self.procs.remove(p)
        if server.returncode != 0 or not out.strip():
            raise RuntimeError(f"rate check failed (server rc {server.returncode})")
        got, secs = out.split()
        return int(got) / float(secs)


_SERVER = textwrap.dedent("""
    import socket, sys, time
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(1); s.settimeout(60)
    c, _ = s.accept(); got = len(c.recv(1 << 20)); t0 = time.perf_counter()
    while got < n:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b)
    print(got, time.perf_counter() - t0)
""")
_CLIENT = textwrap.dedent("""
    import socket, sys, time
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for _ in range(200):
        try:
            s = socket.create_connection((host, port), timeout=60); break
        except OSError:
            time.sleep(0.05)
    buf = b"x" * (1 << 20); sent = 0
    while sent < n:
        sent += s.send(buf[: n - sent])
    s.close()
""")


def kill_group(p: subprocess.Popen) -> None:
    """Kill the process group of ``p`` (started with start_new_session) and reap ``p``."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
