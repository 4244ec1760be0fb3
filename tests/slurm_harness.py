"""A real Slurm on this machine, with SkyPilot's Slurm infra pointed at it, for launching real clusters: the node
`host0` (partition `debug`, the default) and two more nodes, each a slurmd in a network namespace of its own
with its own address on a bridge (partition `pair`, for `num_nodes=2`: Debian's slurmd cannot run twice in one
namespace). SkyPilot gives a job's nodes their NodeAddr as SKYPILOT_NODE_IPS, so the two nodes reach each other as
two machines would.

`tests/setup/30-slurm-skypilot.sh` installs the packages; `start()` starts what is not running (sshd on
127.0.0.1:22 key-only, munged, the bridge and namespaces, slurmctld, the slurmds) and writes SkyPilot's
configuration. Idempotent: a second call, or a second pytest run, finds everything up. The facts behind each step are in
shared/notes/skypilot-on-local-slurm.md. SkyPilot itself edits /root/.ssh and /root/.bashrc: expected on a test box.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from art_sky.errors import ConfigError
from art_sky.provisioners import sky as provisioner
from art_sky.provisioners.sky_env import sky_cli

ALIAS = "localcluster"  # the Host alias in ~/.slurm/config, so SkyPilot's region
INFRA = f"slurm/{ALIAS}"
PAIR_INFRA = f"slurm/{ALIAS}/pair"  # the two namespaced nodes: SkyPilot's zone is the Slurm partition
BRIDGE, BRIDGE_ADDR = "artsky0", "10.77.0.1"  # the "private network": slurmctld listens here for the namespaces
HOST_NODE = "host0"  # the host's own node; named "localhost" beside others, slurmctld dies ("Duplicated NodeHostName")
PAIR = {"pair1": "10.77.0.2", "pair2": "10.77.0.3"}  # node name -> its address, in network namespace artsky-<name>
STATE = Path("/var/lib/art-sky-slurm")  # the harness's own files: key, configs, prolog, uv, python3.10 link
KEY = STATE / "id_ed25519"
PYTHON310 = Path("/root/.pyenv/versions/3.10.13/bin/python3.10")  # SkyPilot's runtime venv wants 3.10
PACKAGES = [
    "/usr/sbin/sshd",
    "/usr/sbin/munged",
    "/usr/sbin/slurmctld",
    "/usr/sbin/slurmd",
    "/usr/bin/sinfo",
    "/usr/bin/rsync",
    "/usr/sbin/ip",
    "/usr/sbin/iptables",
]


def missing() -> str | None:
    """Why this machine cannot run the harness, or None."""
    if os.geteuid() != 0:
        return "the Slurm harness needs root"
    absent = [p for p in PACKAGES if not Path(p).exists()]
    if absent:
        return f"{', '.join(absent)} not installed: run `bash tests/setup/30-slurm-skypilot.sh`"
    if not PYTHON310.exists():
        return f"{PYTHON310} is missing: SkyPilot's runtime needs a Python 3.10"
    if shutil.which("uv") is None and not (Path(sys.executable).parent / "uv").exists():
        return "uv is not installed: run `bash tests/setup/30-slurm-skypilot.sh`"
    return None


no_pair: str | None = None  # after start(): why the pair nodes could not be made here, or None


def start() -> None:
    """Bring up sshd, munge, Slurm and SkyPilot's configuration; raise RuntimeError saying what failed. Where the
    pair nodes cannot be made (no network namespaces here), `no_pair` says why and the host's node runs alone."""
    global no_pair
    STATE.mkdir(parents=True, exist_ok=True)
    _key()
    _sshd()
    _munge()
    _prolog()
    _hosts()
    try:
        _network()
        no_pair = None
    except (subprocess.CalledProcessError, OSError) as exc:
        no_pair = f"no network namespaces for the pair nodes here: {exc} {getattr(exc, 'stderr', '') or ''}".strip()
    _slurm(pair=no_pair is None)
    _sky_config()


def _run(*cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(what: str, ready, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:.0f}s")
        time.sleep(0.5)


def _key() -> None:
    if not KEY.exists():
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "art-sky-slurm-harness", "-f", str(KEY))
    ssh = Path.home() / ".ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    authorized = ssh / "authorized_keys"
    public = (KEY.with_suffix(".pub")).read_text().strip()
    if public not in (authorized.read_text() if authorized.exists() else ""):
        with authorized.open("a") as f:
            f.write(public + "\n")
        authorized.chmod(0o600)


def _sshd() -> None:
    if _listening(22):
        return
    _run("ssh-keygen", "-A")
    Path("/run/sshd").mkdir(exist_ok=True)
    config = STATE / "sshd_config"
    config.write_text(
        "ListenAddress 127.0.0.1\nPort 22\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nPidFile /run/sshd-art-sky-slurm.pid\n"
        "Subsystem sftp /usr/lib/openssh/sftp-server\n"
    )
    _run("/usr/sbin/sshd", "-f", str(config))
    _wait("sshd on 127.0.0.1:22", lambda: _listening(22))


def _munge() -> None:
    if _run("munge", "-n", check=False).returncode == 0:
        return
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        _run("/usr/sbin/mungekey", "--create")
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    _run("runuser", "-u", "munge", "--", "/usr/sbin/munged")
    _wait("munged", lambda: _run("munge", "-n", check=False).returncode == 0)


def _prolog() -> None:
    """The sandbox workarounds, as a Slurm TaskProlog: a pre-placed uv, python3.10 on PATH, the CA bundle."""
    bin_dir = STATE / "bin"
    bin_dir.mkdir(exist_ok=True)
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not (bin_dir / "uv").exists():
        shutil.copy2(uv, bin_dir / "uv")
    link = bin_dir / "python3.10"
    if not link.is_symlink():
        link.symlink_to(PYTHON310)
    prolog = STATE / "task_prolog.sh"
    prolog.write_text(f"""#!/bin/sh
# Lines printed as `export X=Y` enter the task's environment (Slurm TaskProlog).
for d in /root/.sky_clusters/*/; do
  [ -d "$d" ] || continue
  mkdir -p "$d.local/bin" && [ -e "$d.local/bin/uv" ] || cp {bin_dir}/uv "$d.local/bin/uv"
done
echo "export PATH={bin_dir}:$PATH"
echo "export UV_PYTHON_DOWNLOADS=never"
echo "export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"
""")
    prolog.chmod(0o755)


def _hosts() -> None:
    """/etc/hosts names every node's address, as a cluster's DNS would: SkyPilot resolves the job's node names."""
    hosts = Path("/etc/hosts")
    names = {HOST_NODE: "127.0.0.1"} | PAIR
    missing = [f"{addr} {node}" for node, addr in names.items() if f"{addr} {node}" not in hosts.read_text()]
    if missing:
        with hosts.open("a") as f:
            f.write("".join(f"{line}  # art-sky test harness\n" for line in missing))


def _network() -> None:
    """The bridge, and for each pair node a network namespace joined to it by a veth pair (its end named eth0),
    with a default route through the host, which masquerades it: SkyPilot installs its runtime on every node from
    PyPI, as a cloud node behind NAT would."""
    if not Path(f"/sys/class/net/{BRIDGE}").exists():
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    nat = ["POSTROUTING", "-s", f"{BRIDGE_ADDR}/24", "!", "-o", BRIDGE, "-j", "MASQUERADE"]
    if _run("iptables", "-t", "nat", "-C", *nat, check=False).returncode != 0:
        _run("iptables", "-t", "nat", "-A", *nat)
    namespaces = _run("ip", "netns", "list").stdout.split()
    for node, addr in PAIR.items():
        ns = f"artsky-{node}"
        if ns in namespaces:
            continue
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", ns, "master", BRIDGE, "up")
        for command in (
            ["addr", "add", f"{addr}/24", "dev", "eth0"],
            ["link", "set", "eth0", "up"],
            ["link", "set", "lo", "up"],
            ["route", "add", "default", "via", BRIDGE_ADDR],
        ):
            _run("ip", "netns", "exec", ns, "ip", *command)


def _slurm_conf(pair: bool) -> str:
    cpus = os.cpu_count() or 1
    memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
    pair_lines = [
        f"NodeName={node} NodeAddr={addr} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
        for node, addr in PAIR.items()
    ]
    pair_lines.append(f"PartitionName=pair Nodes={','.join(PAIR)} MaxTime=INFINITE State=UP")
    pair_nodes = "\n".join(pair_lines) if pair else ""
    return f"""ClusterName=artsky
SlurmctldHost=localhost{f"({BRIDGE_ADDR})" if pair else ""}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={STATE}/slurmctld
SlurmdSpoolDir={STATE}/slurmd-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile={STATE}/slurmctld.log
SlurmdLogFile={STATE}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog={STATE}/task_prolog.sh
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
NodeName={HOST_NODE} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes={HOST_NODE} Default=YES MaxTime=INFINITE State=UP
{pair_nodes}
"""


NODES = [HOST_NODE, *PAIR]


def _node_state(node: str) -> str:
    result = _run("sinfo", "-h", "-N", "-n", node, "-o", "%T", check=False, timeout=10)
    return result.stdout.strip() if result.returncode == 0 else ""


def _slurmd_running(node: str) -> bool:
    try:
        os.kill(int(Path(f"/run/slurmd-{node}.pid").read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def _slurm(pair: bool) -> None:
    conf = Path("/etc/slurm/slurm.conf")
    wanted = _slurm_conf(pair)
    nodes = NODES if pair else [HOST_NODE]
    if not conf.exists() or conf.read_text() != wanted:
        # New nodes or a new controller address need the daemons restarted, not reconfigured.
        for name in ("slurmctld", "slurmd"):
            _run("pkill", "-x", name, check=False)
        _wait(
            "the old Slurm daemons to stop",
            lambda: _run("pgrep", "-x", "slurmctld|slurmd", check=False).returncode != 0,
        )
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(wanted)
    (STATE / "slurmctld").mkdir(exist_ok=True)
    if _run("pgrep", "-x", "slurmctld", check=False).returncode != 0:
        _run("/usr/sbin/slurmctld")
        _wait("slurmctld", lambda: _run("scontrol", "ping", check=False, timeout=10).returncode == 0)
    for node in nodes:
        (STATE / f"slurmd-{node}").mkdir(exist_ok=True)
        if not _slurmd_running(node):
            if node not in PAIR:
                _run("/usr/sbin/slurmd", "-N", node)
                continue
            # Its own network namespace (nsenter, not `ip netns exec`, which remounts /sys and leaves slurmd no
            # cgroup filesystem) and its own hostname: SkyPilot finds a node's IP by resolving its hostname.
            _run(
                "nsenter",
                f"--net=/run/netns/artsky-{node}",
                "unshare",
                "--uts",
                "sh",
                "-c",
                f"hostname {node} && exec /usr/sbin/slurmd -N {node}",
            )
    for node in nodes:
        _wait(f"the Slurm node {node}", lambda node=node: _node_state(node) not in ("", "unknown", "unknown*"))
        if any(s in _node_state(node) for s in ("down", "drain")):
            _run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        _wait(
            f"the Slurm node {node} idle or allocated",
            lambda node=node: _node_state(node).rstrip("*") in ("idle", "mixed", "allocated"),
        )


def _sky_config() -> None:
    slurm = Path.home() / ".slurm"
    slurm.mkdir(exist_ok=True)
    (slurm / "config").write_text(
        f"Host {ALIAS}\n  HostName 127.0.0.1\n  Port 22\n  User root\n  IdentityFile {KEY}\n  IdentitiesOnly yes\n"
    )
    sky = Path.home() / ".sky"
    sky.mkdir(exist_ok=True)
    config = sky / "config.yaml"
    wanted = "slurm:\n  provision_timeout: 30\n"
    if not config.exists() or config.read_text() != wanted:
        config.write_text(wanted)


def node_of(pid: int) -> str | None:
    """The pair node whose network namespace process `pid` runs in; None for the host's (and `host0`'s)."""
    net = os.stat(f"/proc/{pid}/ns/net").st_ino
    return next((node for node in PAIR if os.stat(f"/run/netns/artsky-{node}").st_ino == net), None)


def slurm_jobs(name_prefix: str) -> list[str]:
    """Names of live Slurm jobs whose name starts with `name_prefix`.

    A cancelled job stays in squeue as COMPLETING (CG) while slurmd reaps its processes: it is ending, not live.
    """
    result = _run("squeue", "-h", "-o", "%j %t", check=False, timeout=10)
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()]
    return [name for name, state in rows if name.startswith(name_prefix) and state != "CG"]


def enable_sky() -> None:
    """Start SkyPilot's API server (if none runs) and enable the local Slurm: `sky check slurm`, with the CLI of
    SkyPilot's own environment (art_sky/provisioners/sky_env.py)."""
    result = subprocess.run([sky_cli(), "check", "slurm"], capture_output=True, text=True, timeout=600)
    try:
        asyncio.run(provisioner.check_infra({"resources": {"infra": INFRA}}))
    except ConfigError as exc:
        raise RuntimeError(
            f"`sky check slurm` did not enable the local Slurm ({exc}): see ~/.slurm/config\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        ) from None


def down_clusters(prefix: str) -> None:
    """Tear down every SkyPilot cluster whose name starts with `prefix` (what this test run launched)."""
    for record in asyncio.run(provisioner.status()):
        if record.name.startswith(prefix):
            asyncio.run(provisioner.down(record.name))
    # A job ended by `scancel` (a preemption) never ran its cleanup, which removes the cluster's home and the node's
    # SkyPilot runtime (~0.4 GB): a preempted VM's disk goes with it, this machine's stays.
    for home in [*Path.home().glob(f".sky_clusters/{prefix}*"), *Path("/tmp").glob(f"{prefix}*")]:
        shutil.rmtree(home, ignore_errors=True)


def preempt(name_prefix: str) -> list[str]:
    """End the live Slurm jobs whose name starts with `name_prefix` (`scancel`), as a spot preemption ends a
    cluster's VM; returns their ids."""
    result = _run("squeue", "-h", "-o", "%i %j %t", check=False, timeout=10)
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()]
    ids = [job for job, name, state in rows if name.startswith(name_prefix) and state != "CG"]
    if ids:
        _run("scancel", *ids)
    return ids


def set_partition(partition: str, state: str) -> None:
    """Make a Slurm partition INACTIVE (it refuses new jobs: a cloud without capacity) or UP again."""
    _run("scontrol", "update", f"PartitionName={partition}", f"State={state}")


def wait_jobs_gone(ids: list[str], timeout: float = 60) -> None:
    """Until Slurm lists none of these jobs (a cancelled job's processes are reaped, KillWait at most)."""

    def gone() -> bool:
        listed = _run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
        return not set(ids) & set(listed)

    _wait(f"Slurm jobs {', '.join(ids)} to end", gone, timeout)
