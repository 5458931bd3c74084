#!/usr/bin/env python3
"""A real SLURM cluster of three emulated nodes on this one host, for tests/test_slurm_real.py and CI.

    python tools/slurm_cluster.py start                       # root; installs SLURM with apt-get if missing
    export SLURM_CONF=/tmp/inprocess-slurm/slurm.conf         # what `start` prints: sbatch, srun, ... use it
    python tools/slurm_cluster.py status
    python tools/slurm_cluster.py kill-node inprocess-node2   # the node is lost (its daemons and processes)
    python tools/slurm_cluster.py start-node inprocess-node2  # ... and comes back
    python tools/slurm_cluster.py stop

Debian's slurm-wlm (22.05) is built with multiple-slurmd support: one ``slurmd -N <node>`` per node, each
with its own port and address (``NodeAddr=127.0.2.<i>``: the loopback network covers 127.0.0.0/8), all
on this host. It runs with a private ``munged`` (own key and socket), ``proctrack/linuxproc`` (no cgroups),
``task/affinity`` (with ``task/none`` srun refuses ``--cpu-bind=none``), ``select/cons_tres`` with 32 CPUs
and 4 fake GPUs per node (``gres.conf`` ``File=`` entries: symlinks to /dev/null, a character device;
``SlurmdParameters=config_overrides`` lets the configuration claim more CPUs than the host has),
``ReturnToService=2`` (a node that was lost rejoins when its slurmd registers again), and short timers so
that a requeued job restarts in seconds, not minutes (``cred_expire=5``: a requeued job waits that long;
``sched_interval=1``, ``bf_interval=1``) and a lost node is marked down after ``SlurmdTimeout``.

The node names must resolve (the recipes use the first one as the store's address): ``start`` adds one
line per node to /etc/hosts, each marked with this cluster's directory, and ``stop`` removes exactly
those lines.

What it starts, and only that, it stops: the daemons carry ``INPROCESS_SLURM_CLUSTER=<dir>`` in their
environment (slurmstepd inherits it from slurmd), and the jobs' processes ``SLURMD_NODENAME=<one of the
nodes>`` (SLURM sets it in every task); ``stop`` cancels the jobs, ends those processes and the private
munged, and leaves the logs in the directory. ``start`` on a running cluster changes nothing; ``stop``
on a stopped one neither. Not emulated: cgroups, a network namespace per node (a lost node's
connections are reset at once here, where a real one's go silent).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable

DIR = pathlib.Path(os.environ.get("INPROCESS_SLURM_DIR", "/tmp/inprocess-slurm"))
NODES = ("inprocess-node1", "inprocess-node2", "inprocess-node3")
CTLD_PORT = 16817
FIRST_NODE_PORT = 16818
GPUS_PER_NODE = 4
CPUS_PER_NODE = 32
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "munged")
MARK = "INPROCESS_SLURM_CLUSTER"  # in the environment of every daemon this script starts
NODE_MARK = "INPROCESS_SLURM_NODE"  # and the node, in a slurmd's (and so its slurmstepds')
HOSTS = pathlib.Path("/etc/hosts")


def node_address(node: str) -> str:
    return f"127.0.2.{NODES.index(node) + 1}"


def say(text: str) -> None:
    print(f"slurm_cluster: {text}", file=sys.stderr, flush=True)


class Cluster:
    """The files of one cluster, under ``root``."""

    def __init__(self, root: pathlib.Path = DIR):
        self.root = root
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge.sock"
        self.state = root / "started.json"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of SLURM's commands for this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf), **extra)

    def hosts_mark(self) -> str:
        return f"# {MARK}={self.root}"

    # -- configuration -------------------------------------------------------------

    def write_config(self) -> None:
        r = self.root
        for sub in ("ctld", "spool", "gpu"):
            shutil.rmtree(r / sub, ignore_errors=True)
        (r / "ctld").mkdir(parents=True)
        lines = [
            "ClusterName=inprocess",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={CTLD_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"StateSaveLocation={r}/ctld",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/affinity",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "GresTypes=gpu",
            "ReturnToService=2",
            "SchedulerParameters=bf_interval=1,sched_interval=1",
            "SlurmdTimeout=10",
            "KillWait=5",
            "MinJobAge=600",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        gres = ["AutoDetect=off"]
        for i, node in enumerate(NODES):
            lines.append(f"NodeName={node} NodeAddr={node_address(node)} NodeHostname=localhost "
                         f"Port={FIRST_NODE_PORT + i} CPUs={CPUS_PER_NODE} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN")
            devices = r / "gpu" / node
            devices.mkdir(parents=True)
            for g in range(GPUS_PER_NODE):
                (devices / f"nvidia{g}").symlink_to("/dev/null")
            gres.append(f"NodeName={node} Name=gpu File={devices}/nvidia[0-{GPUS_PER_NODE - 1}]")
            (r / "spool" / node).mkdir(parents=True)
        lines.append(f"PartitionName=main Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "gres.conf").write_text("\n".join(gres) + "\n")
        self.conf.chmod(0o644)

    # -- /etc/hosts ----------------------------------------------------------------

    def add_hosts(self) -> None:
        self.remove_hosts()
        text = HOSTS.read_text() if HOSTS.exists() else ""
        if text and not text.endswith("\n"):
            text += "\n"
        text += "".join(f"{node_address(n)} {n} {self.hosts_mark()}\n" for n in NODES)
        _write_in_place(HOSTS, text)

    def remove_hosts(self) -> None:
        if not HOSTS.exists():
            return
        lines = HOSTS.read_text().splitlines(keepends=True)
        kept = [line for line in lines if not line.rstrip("\n").endswith(self.hosts_mark())]
        if kept != lines:
            _write_in_place(HOSTS, "".join(kept))

    # -- processes -----------------------------------------------------------------

    def daemons(self, node: str | None = None) -> list[int]:
        """The pids of this cluster's daemons (of one node's slurmd and slurmstepds, with ``node``)."""
        if node is None:
            return pids_with(f"{MARK}={self.root}")
        return [p for p in pids_with(f"{NODE_MARK}={node}") if p in set(pids_with(f"{MARK}={self.root}"))]

    def job_processes(self, nodes: Iterable[str] = NODES) -> list[int]:
        """The processes of the jobs that run on ``nodes`` (SLURM sets SLURMD_NODENAME in every task)."""
        found: list[int] = []
        for node in nodes:
            found += pids_with(f"SLURMD_NODENAME={node}")
        return found

    def answers(self) -> bool:
        try:
            res = subprocess.run(["scontrol", "ping"], env=self.env(), capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return res.returncode == 0 and "UP" in res.stdout

    def node_states(self) -> dict[str, str]:
        try:
            res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(), capture_output=True,
                                 text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        return dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)

    def wait_idle(self, nodes: Iterable[str] = NODES, timeout_s: float = 120.0) -> None:
        nodes = list(nodes)
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(states.get(n) == "idle" for n in nodes):
                return
            time.sleep(0.5)
        raise TimeoutError(f"nodes {nodes} not idle after {timeout_s:g}s: {states}; logs in {self.root}")

    # -- start and stop ------------------------------------------------------------

    def running(self) -> bool:
        """Every daemon this cluster needs runs, and the controller answers."""
        if not self.state.exists():
            return False
        started = json.loads(self.state.read_text())
        alive = set(self.daemons())
        return all(pid in alive for pid in started["daemons"].values()) and self.answers()

    def start(self) -> None:
        install()
        if self.running():
            say(f"running already ({self.conf})")
            return
        self.stop(quiet=True)  # whatever a half-started cluster left
        check_ports_free()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)  # munged wants every directory above its socket searchable by all
        self.write_config()
        started = {"munged": self.start_munged()}
        started["slurmctld"] = self.spawn(["slurmctld", "-D", "-c", "-f", str(self.conf)], "slurmctld")
        for node in NODES:
            started[node] = self.start_slurmd(node)
        self.state.write_text(json.dumps({"daemons": started}))
        self.add_hosts()
        try:
            self.wait_idle()
        except TimeoutError:
            self.stop(quiet=True)
            raise
        say(f"{len(NODES)} nodes idle; export SLURM_CONF={self.conf}")

    def start_munged(self) -> int:
        key = self.root / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        pidfile = self.root / "munged.pid"
        subprocess.run(["munged", f"--socket={self.munge_socket}", f"--key-file={key}", f"--pid-file={pidfile}",
                        f"--log-file={self.root / 'munged.log'}", f"--seed-file={self.root / 'munged.seed'}"],
                       env=dict(os.environ, **{MARK: str(self.root)}), check=True, timeout=30)
        return int(pidfile.read_text())

    def spawn(self, argv: list[str], name: str, **env: str) -> int:
        log = open(self.root / f"{name}.out", "ab")
        proc = subprocess.Popen(argv, env=dict(self.env(), **{MARK: str(self.root)}, **env), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return proc.pid

    def start_slurmd(self, node: str) -> int:
        return self.spawn(["slurmd", "-D", "-N", node, "-f", str(self.conf)], f"slurmd.{node}", **{NODE_MARK: node})

    def stop(self, quiet: bool = False) -> None:
        if self.answers():
            subprocess.run(["scancel", "--full", "--quiet", *self.jobs()], env=self.env(), capture_output=True,
                           timeout=30)
            deadline = time.monotonic() + 20
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        daemons = [p for p in self.daemons() if _name(p) != "munged"]
        end(daemons, grace_s=10.0)
        end(self.job_processes(), grace_s=5.0)
        end(self.daemons(), grace_s=5.0)  # munged last: the others needed it to shut down
        self.remove_hosts()
        self.state.unlink(missing_ok=True)
        if not quiet:
            say(f"stopped (logs in {self.root})")

    def jobs(self) -> list[str]:
        try:
            res = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(), capture_output=True, text=True,
                                 timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return []
        return res.stdout.split() if res.returncode == 0 else []

    # -- losing a node -------------------------------------------------------------

    def kill_node(self, node: str) -> list[int]:
        """Lose ``node`` as a whole: its slurmd, its slurmstepds and every process of a job on it,
        stopped together (SIGSTOP) and then killed, so that none of them reports the others' end."""
        victims = sorted(set(self.daemons(node)) | set(self.job_processes([node])))
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in victims:
                _signal(pid, sig)
        _wait_gone(victims, 10.0)
        return victims

    def start_node(self, node: str, timeout_s: float = 120.0) -> None:
        """The node comes back: its slurmd again, which registers and (ReturnToService=2) makes it idle."""
        if not self.daemons(node):
            pid = self.start_slurmd(node)
            started = json.loads(self.state.read_text())
            started["daemons"][node] = pid
            self.state.write_text(json.dumps(started))
        self.wait_idle([node], timeout_s)


def _name(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def pids_with(entry: str, also: str | None = None) -> list[int]:
    """Processes whose environment holds ``entry`` (and ``also``, when given): exact ``NAME=value`` items."""
    want = [entry.encode()] + ([also.encode()] if also else [])
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            items = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(w in items for w in want):
            found.append(int(proc.name))
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    return left


def end(pids: Iterable[int], grace_s: float) -> None:
    """SIGTERM, then SIGKILL whatever is still there after ``grace_s``."""
    pids = list(pids)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    for pid in _wait_gone(pids, grace_s):
        _signal(pid, signal.SIGKILL)
    _wait_gone(pids, 5.0)


def _write_in_place(path: pathlib.Path, text: str) -> None:
    # In place, not by rename: /etc/hosts is often a bind mount (containers), which a rename cannot replace.
    with open(path, "r+") as f:
        f.write(text)
        f.truncate()


def check_ports_free() -> None:
    for port in (CTLD_PORT, *range(FIRST_NODE_PORT, FIRST_NODE_PORT + len(NODES))):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError as e:
                raise RuntimeError(f"port {port} is taken ({e}): the cluster needs {CTLD_PORT}.."
                                   f"{FIRST_NODE_PORT + len(NODES) - 1}") from None


def install() -> None:
    """SLURM's daemons, its commands and munge from the distribution, when missing (Debian: apt-get, as root)."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"{', '.join(missing)} missing: install {' '.join(PACKAGES)} (as root, with apt-get)")
    say(f"installing {' '.join(PACKAGES)} ({', '.join(missing)} missing)")
    # A policy-rc.d that denies every start, while apt installs: its packages' own services stay off.
    policy = pathlib.Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    try:
        if subprocess.run(command, env=env, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, check=True, timeout=600)
            subprocess.run(command, env=env, check=True, timeout=600)
    finally:
        if ours:
            policy.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("start", "stop", "status", "kill-node", "start-node"))
    parser.add_argument("node", nargs="?", choices=NODES)
    args = parser.parse_args(argv)
    cluster = Cluster()
    if args.command in ("kill-node", "start-node") and args.node is None:
        parser.error(f"{args.command} needs a node: one of {', '.join(NODES)}")
    if args.command == "start":
        cluster.start()
    elif args.command == "stop":
        cluster.stop()
    elif args.command == "status":
        running = cluster.running()
        print(json.dumps({"running": running, "conf": str(cluster.conf), "nodes": cluster.node_states()}))
        return 0 if running else 1
    elif args.command == "kill-node":
        say(f"{args.node} lost: {len(cluster.kill_node(args.node))} processes killed")
    else:
        cluster.start_node(args.node)
        say(f"{args.node} is back and idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
