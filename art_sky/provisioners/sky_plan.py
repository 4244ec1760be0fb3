"""What launching a SkyPilot cluster would rent, known before anything is rented: what the user asked (GPUs, nodes,
spot, infra, autostop) beside SkyPilot's own choice and price, read from the table its optimizer prints (what
`sky launch` shows before it asks; its request returns nothing else). `art-sky up` shows it and asks first."""

from __future__ import annotations

import re

from pydantic import BaseModel

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
CHOSEN_MARK = "✔"  # SkyPilot's optimizer marks the row it chose


class LaunchPlan(BaseModel):
    """A launch about to happen: the ask, and SkyPilot's choice (its table row) where its optimizer printed one."""

    cluster: str
    gpus: list[str] | None  # in the order tried; None: CPUs only
    nodes: int
    spot: bool
    infra: str | None  # as asked; None: any enabled
    autostop_minutes: int | None
    chosen: dict[str, str] = {}  # SkyPilot's row: INFRA (with its region), INSTANCE, vCPUs, Mem(GB), GPUS, COST ($)
    table: str = ""  # SkyPilot's optimizer table as it printed it

    @property
    def hourly_cost(self) -> float | None:
        """SkyPilot's price of its choice in $ an hour (every node); None where it showed none."""
        try:
            return float(self.chosen["COST ($)"])
        except (KeyError, ValueError):
            return None

    def lines(self) -> list[str]:
        """The plan as `art-sky up` shows it, one fact a line."""
        where = self.chosen.get("INFRA") or self.infra or "any enabled infra (SkyPilot's choice)"
        instance = self.chosen.get("INSTANCE", "-")
        price = self.hourly_cost
        return [
            f"SkyPilot cluster {self.cluster!r} is not up: launching it rents",
            f"  GPUs:     {', then '.join(self.gpus) if self.gpus else 'none (CPUs only)'}"
            f"{' per node' if self.gpus and self.nodes > 1 else ''}",
            f"  nodes:    {self.nodes}",
            f"  spot:     {'yes (cheaper; can be preempted)' if self.spot else 'no (on-demand)'}",
            f"  where:    {where}{f', instance {instance}' if instance not in ('', '-') else ''}",
            "  price:    "
            + (f"${price:.2f}/hour (SkyPilot's price)" if price is not None else "unknown (SkyPilot shows none)"),
            "  autostop: "
            + (
                f"torn down after {self.autostop_minutes} idle minutes"
                if self.autostop_minutes
                else f"off: it runs, and bills, until `art-sky down {self.cluster}`"
            ),
        ]


def chosen_row(table: str) -> dict[str, str]:
    """The row SkyPilot's optimizer table marks as chosen, by its column names; {} when there is none to read."""
    rows = [_ANSI.sub("", line).rstrip() for line in table.splitlines()]
    header = next((line for line in rows if "CHOSEN" in line and "INFRA" in line), None)
    chosen = next((line for line in rows if CHOSEN_MARK in line), None)
    if header is None or chosen is None:
        return {}
    names = re.split(r"\s{2,}", header.strip())
    cells = re.split(r"\s{2,}", chosen.strip())
    if len(cells) != len(names):
        return {}
    return {name: cell for name, cell in zip(names, cells, strict=True) if name != "CHOSEN"}
