"""A throwaway Slurm cluster on this machine, for the tests that submit real jobs.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (22.05; ``.ci/run`` installs
them as root): one ``munged`` with its own key and socket, one ``slurmctld`` and one ``slurmd``
per node (``slurmd -N nK``, each on its own port), all in the foreground as children of the test
process, one partition over all nodes. Node names (``n1``, ``n2``, ...) do not resolve; every
node's ``NodeAddr`` is 127.0.0.1, so a launcher has to take addresses from Slurm.

Jobs are accounted by ``jobcomp/filetxt`` (no database): ``sacct --completion`` reads them.
:meth:`SlurmCluster.stop` cancels every job, stops every daemon, then fails if any process it
started (a daemon, a ``slurmstepd``, a job's process: they carry ``LOCO_SLURM_CLUSTER`` in their
environment) is still alive, killing it first.
"""

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "sacct")
MARK = "LOCO_SLURM_CLUSTER"


def unavailable_reason() -> Optional[str]:
    """Why a cluster cannot start here (None: it can): not root, or a package missing."""
    missing = [d for d in DAEMONS if shutil.which(d) is None
               and not Path("/usr/sbin", d).exists()]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install "
                f"slurmctld slurmd slurm-client munge (as root; .ci/run does)")
    if os.geteuid() != 0:
        return "the Slurm test cluster runs its daemons as root (SlurmUser=root): run as root"
    return None


def _free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _marked_pids(mark: str) -> List[int]:
    """Live processes whose environment holds ``LOCO_SLURM_CLUSTER=<mark>``."""
    needle = f"{MARK}={mark}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


class SlurmCluster:
    """One controller and ``nodes`` node daemons under ``root`` (a fresh directory).

    Attributes:
        env: the environment for Slurm's commands and for jobs (``SLURM_CONF`` and the mark).
        nodes: node names, ``["n1", "n2", ...]``.
    """

    def __init__(self, root: Path, nodes: int = 2, cpus: int = 4):
        self.root = Path(root)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.procs: Dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        self.env.update(SLURM_CONF=str(self.root / "slurm.conf"), **{MARK: str(self.root)})
        atexit.register(self._kill_all)  # pytest itself ending early (a CI timeout's SIGTERM)

    def _kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()

    def _write_config(self) -> None:
        r = self.root
        ctld, *node_ports = _free_ports(1 + len(self.nodes))
        lines = [
            "ClusterName=loco-test", "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld}", "SlurmUser=root", "SlurmdUser=root",
            # cred_expire: a requeued job waits this long before it may start again (default
            # 120 s); sched_interval: how often pending jobs are retried (default 60 s). Both
            # only shorten the preemption test's idle wait.
            "AuthType=auth/munge", f"AuthInfo=socket={r}/munge.socket,cred_expire=20",
            "CredType=cred/munge",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin", "SchedulerParameters=sched_interval=2",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={r}/jobcomp.txt",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "ReturnToService=2",
            # job ids (and the per-job master ports derived from them) differ from another
            # test cluster's on the same machine
            f"FirstJobId={random.randrange(1000, 20000)}",
            "SlurmdParameters=config_overrides", "KillWait=10", "MinJobAge=3600",
        ]
        for name, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname=localhost "
                         f"Port={port} CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES "
                     f"MaxTime=INFINITE State=UP OverSubscribe=YES")
        (r / "slurm.conf").write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: List[str]) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        """Start munged, slurmctld and the node daemons; wait until every node is idle.

        Raises:
            RuntimeError: a daemon exited or the nodes are not idle in ``timeout_s``
                (the message holds the daemons' logs).
        """
        r = self.root
        for d in ["state", *(f"spool-{n}" for n in self.nodes)]:
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._write_config()
        self._spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={r}/munge.socket", f"--pid-file={r}/munged.pid",
                               f"--log-file={r}/munged.log", f"--seed-file={r}/munge.seed"])
        self._wait(lambda: (r / "munge.socket").exists(), timeout_s, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(r / "slurm.conf")])
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(r / "slurm.conf")])
        self._wait(lambda: self.sinfo_states() == {"idle"}, timeout_s, "idle nodes")
        return self

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = {k: p.returncode for k, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"Slurm test cluster: {dead} exited while waiting for "
                                   f"{what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm test cluster: no {what} after {timeout_s} s:\n{self.logs()}")

    def run(self, *argv: str, check: bool = True, timeout: float = 60,
            env: Optional[Dict[str, str]] = None) -> str:
        """A Slurm command (``sbatch``, ``scontrol``, ...) against this cluster; its stdout.
        ``env`` (default :attr:`env`) must keep ``SLURM_CONF`` and the mark."""
        proc = subprocess.run(list(argv), env=env or self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def sinfo_states(self) -> set:
        """States of the nodes (``{"idle"}`` when ready)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%t", check=False)
        return set(out.split())

    def sacct(self, job_id: str) -> List[Dict[str, str]]:
        """Every completion record of a job (a requeued job has several), oldest first."""
        fields = "JobID,JobName,State,ExitCode,NodeList,Start,End"
        out = self.run("sacct", "--completion", "-n", "-P", "-j", job_id, "-o", fields,
                       check=False)
        names = fields.split(",")
        return [dict(zip(names, ln.split("|"))) for ln in out.splitlines() if ln.strip()]

    def wait_job(self, job_id: str, timeout_s: float) -> List[Dict[str, str]]:
        """Wait until the job has left the queue; its completion records.

        Raises:
            TimeoutError: still queued or running after ``timeout_s`` (it is cancelled).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", "-j", job_id, check=False).strip():
                return self.sacct(job_id)
            time.sleep(1)
        self.run("scancel", job_id, check=False)
        raise TimeoutError(f"Slurm job {job_id} still in the queue after {timeout_s} s")

    def logs(self) -> str:
        """The tail of every daemon's log, for failure messages."""
        out = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace")
                                                     .splitlines()[-15:]))
        return "\n".join(out)

    def stop(self) -> List[str]:
        """Cancel every job, stop every daemon; kill anything left. Returns what was left.

        Leftovers: daemons that ignored SIGTERM for 15 s, and marked processes (job steps,
        ranks) still alive after the daemons stopped; each is killed with SIGKILL.
        """
        left = []
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:  # a hung controller must not keep the daemons alive
                self.run("scancel", "--user=root", check=False)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and self.run(
                        "squeue", "-h", check=False).strip():
                    time.sleep(0.5)
            except (subprocess.TimeoutExpired, OSError) as e:
                left.append(f"slurmctld did not answer while cancelling jobs: {e}")
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                left.append(f"{name} (pid {p.pid}) ignored SIGTERM")
                p.kill()
                p.wait()
        time.sleep(0.5)
        for pid in _marked_pids(str(self.root)):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                os.kill(pid, signal.SIGKILL)
                left.append(f"pid {pid}: {cmd[:120]}")
            except (OSError, ProcessLookupError):
                continue
        return left
