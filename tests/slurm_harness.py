"""A real single-node Slurm on localhost, with SkyPilot's Slurm infra pointed at it, for launching real clusters.

`tests/setup/30-slurm-skypilot.sh` installs the packages; `start()` starts what is not running (sshd on
127.0.0.1:22 key-only, munged, slurmctld, slurmd) and writes SkyPilot's configuration. Idempotent: a second
call, or a second pytest run, finds everything up. The facts behind each step are in
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
STATE = Path("/var/lib/art-sky-slurm")  # the harness's own files: key, configs, prolog, uv, python3.10 link
KEY = STATE / "id_ed25519"
PYTHON310 = Path("/root/.pyenv/versions/3.10.13/bin/python3.10")  # SkyPilot's runtime venv wants 3.10
PACKAGES = ["/usr/sbin/sshd", "/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sinfo",
            "/usr/bin/rsync"]


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


def start() -> None:
    """Bring up sshd, munge, Slurm and SkyPilot's configuration; raise RuntimeError saying what failed."""
    STATE.mkdir(parents=True, exist_ok=True)
    _key()
    _sshd()
    _munge()
    _prolog()
    _slurm()
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
        "Subsystem sftp /usr/lib/openssh/sftp-server\n")
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


def _slurm_conf() -> str:
    cpus = os.cpu_count() or 1
    memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
    return f"""ClusterName=artsky
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={STATE}/slurmctld
SlurmdSpoolDir={STATE}/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile={STATE}/slurmctld.log
SlurmdLogFile={STATE}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog={STATE}/task_prolog.sh
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _node_state() -> str:
    result = _run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=10)
    return result.stdout.strip() if result.returncode == 0 else ""


def _slurm() -> None:
    conf = Path("/etc/slurm/slurm.conf")
    wanted = _slurm_conf()
    changed = not conf.exists() or conf.read_text() != wanted
    if changed:
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(wanted)
    for d in ("slurmctld", "slurmd"):
        (STATE / d).mkdir(exist_ok=True)
    running = {name: _run("pgrep", "-x", name, check=False).returncode == 0 for name in ("slurmctld", "slurmd")}
    if changed and any(running.values()):
        _run("scontrol", "reconfigure", check=False)
    if not running["slurmctld"]:
        _run("/usr/sbin/slurmctld")
        _wait("slurmctld", lambda: _run("scontrol", "ping", check=False, timeout=10).returncode == 0)
    if not running["slurmd"]:
        _run("/usr/sbin/slurmd", "-N", "localhost")
    _wait("the Slurm node", lambda: _node_state() != "" and _node_state() not in ("unknown", "unknown*"))
    if any(s in _node_state() for s in ("down", "drain")):
        _run("scontrol", "update", "nodename=localhost", "state=resume", check=False)
    _wait("an idle or allocated Slurm node", lambda: _node_state().rstrip("*") in ("idle", "mixed", "allocated"))


def _sky_config() -> None:
    slurm = Path.home() / ".slurm"
    slurm.mkdir(exist_ok=True)
    (slurm / "config").write_text(
        f"Host {ALIAS}\n  HostName 127.0.0.1\n  Port 22\n  User root\n  IdentityFile {KEY}\n  IdentitiesOnly yes\n")
    sky = Path.home() / ".sky"
    sky.mkdir(exist_ok=True)
    config = sky / "config.yaml"
    wanted = "slurm:\n  provision_timeout: 30\n"
    if not config.exists() or config.read_text() != wanted:
        config.write_text(wanted)


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
        raise RuntimeError(f"`sky check slurm` did not enable the local Slurm ({exc}): see ~/.slurm/config\n"
                           f"{result.stdout[-2000:]}{result.stderr[-2000:]}") from None


def down_clusters(prefix: str) -> None:
    """Tear down every SkyPilot cluster whose name starts with `prefix` (what this test run launched)."""
    for record in asyncio.run(provisioner.status()):
        if record.name.startswith(prefix):
            asyncio.run(provisioner.down(record.name))
