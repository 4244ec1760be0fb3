"""A step's rollouts for the dashboard's step view, from the run's rollouts.jsonl (the server appends a line per
GRPO step, cluster/rollouts.py): its groups, each trajectory's conversation, reward, advantage and skip reason. A cut
last line or a line that is not JSON is left out and said; a long message is cut for the page, whole on demand.
"""

from __future__ import annotations

import json
from pathlib import Path

from art_sky.layout import ROLLOUTS, model_key

SHOWN_CHARS = 4000  # of a message's text on the page; the rest on demand (`full`)


def read_rollouts(root: Path, run_id: str, step: int, full: bool = False) -> dict:
    """Step `step`'s groups from run `run_id`'s rollouts.jsonl (its last line for the step), each message's text
    cut to SHOWN_CHARS unless `full`; `error` says why there are none."""
    project, _, name = run_id.partition("/")
    folder = root / model_key(project, name)
    path = folder / ROLLOUTS
    if not name or "/" in name or ".." in (project, name) or not folder.is_dir():
        return {"step": step, "groups": [], "error": f"no run {run_id!r} under {root}"}
    try:
        lines = path.read_text(errors="replace").split("\n")
    except FileNotFoundError:
        return {
            "step": step,
            "groups": [],
            "error": f"{path} does not exist: the server that trained this run kept "
            "no rollouts (an older art-sky, or SFT steps only)",
        }
    except OSError as exc:
        return {"step": step, "groups": [], "error": f"{path} could not be read ({exc.strerror or exc})"}
    found, problems = None, []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            last = number == len(lines)
            problems.append(
                f"the last line of {path} is cut (the run stopped while writing it)"
                if last
                else f"line {number} of {path} is not JSON: left out"
            )
            continue
        if isinstance(value, dict) and value.get("step") == step:
            found = value
    if found is None:
        return {
            "step": step,
            "groups": [],
            "problems": problems,
            "error": f"{path} has no line for step {step}" + (": " + "; ".join(problems) if problems else ""),
        }
    groups = _groups(found.get("groups"))
    if not full:
        for group in groups:
            for trajectory in group["trajectories"]:
                for message in trajectory["messages"]:
                    text = message.get("content")
                    if isinstance(text, str) and len(text) > SHOWN_CHARS:
                        message["content"], message["cut"] = text[:SHOWN_CHARS], len(text)
    return {"step": step, "groups": groups, "problems": problems, "error": None}


def _groups(value: object) -> list[dict]:
    """The line's groups in the shape the page reads (a group, trajectory or message of another shape left out)."""
    groups = []
    for group in value if isinstance(value, list) else []:
        if isinstance(group, dict) and isinstance(group.get("trajectories"), list):
            trajectories = [
                t | {"messages": [m for m in t["messages"] if isinstance(m, dict)]}
                for t in group["trajectories"]
                if isinstance(t, dict)
                and isinstance(t.get("messages"), list)
                and isinstance(t.get("reward"), float | int)
            ]
            groups.append(group | {"trajectories": trajectories})
    return groups
