"""A remote command in a process group of its own that ends with its SSH session.

Without this, a `pip install` whose client was interrupted (Ctrl-C, a lost connection) goes on as an orphan on the
box and holds the venv the next `up` needs: sshd gives a command no terminal, so nothing sends it SIGHUP. `command`
wraps a script so that it runs under `setsid` with a watchdog in its group that reads the session's stdin: the
client never closes its side while the script runs, so end of file there means the session is gone (the client
closed the channel on an interrupt, or the connection died with the client or the network), and the watchdog sends
SIGTERM to the whole group, then SIGKILL after `GRACE` seconds. The script's own stdin (secrets, a file's text) is
the first `len(stdin)` bytes of the session's, read before the watchdog starts. A process the script detaches into a
session of its own (the cluster server's `--detach`, a CI job's `setsid nohup`) is not in the group and lives on.
"""

from __future__ import annotations

import shlex

GRACE = 3  # seconds between the group's SIGTERM and its SIGKILL

# In the new session ($1: the script; stdin: its bytes; fd 3: the session's stdin, which stays open while it lives).
_INNER = f"""( trap '' TERM
  while read -r _ <&3; do :; done
  kill -TERM 0; sleep {GRACE}; kill -KILL 0 ) >/dev/null 2>&1 </dev/null &
w=$!
exec 3<&-
sh -c "$1"
rc=$?
kill -KILL "$w" 2>/dev/null
exit "$rc"
"""

# What the login shell runs ($1: how many bytes of stdin are the script's; $2: the script). `setsid` (util-linux) is
# on every Linux; without it the group is the one sshd made for the session, which the watchdog stops as well.
_OUTER = f"""payload=$(dd bs=1 count="$1" 2>/dev/null; echo .)
payload=${{payload%.}}
exec 3<&0
s=setsid; command -v setsid >/dev/null 2>&1 || s=
printf %s "$payload" | $s sh -c {shlex.quote(_INNER)} art-sky "$2"
"""


def command(script: str, stdin: bytes) -> str:
    """The command line that runs `script` with `stdin` (text: a shell variable carries it, so no NUL bytes) in a
    group that ends with the session. The caller sends `stdin` and keeps its side of the channel open until the
    command has exited."""
    if b"\0" in stdin:
        raise ValueError("a remote command's stdin is text: it cannot carry NUL bytes")
    return f"sh -c {shlex.quote(_OUTER)} art-sky {len(stdin)} {shlex.quote(script)}"
