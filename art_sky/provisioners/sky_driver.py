"""SkyPilot's side of the provisioner: run by the interpreter of SkyPilot's own environment (sky_env.py), never
imported by art-sky, so SkyPilot's pins (click < 8.2) stay out of the user's environment.

`python -P sky_driver.py OP` (-P: this folder, whose sky.py is art-sky's, stays off the path) reads the call's
arguments as JSON on stdin, runs one SkyPilot SDK request and writes what the request logs to stdout as it comes;
its control lines start with MARK, then JSON: the request's id ({"request_id": ...}, to cancel it), then
{"result": ...} or {"error": KIND, "message": ...}. Only the standard library and SkyPilot here.
"""

from __future__ import annotations

import copy
import json
import sys
import time

MARK = "::art-sky-driver:: "  # starts a control line; a log line never does


def say(**message) -> None:
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def task(config: dict):
    """The task from its config, checked with SkyPilot's schema (a ValueError names what is wrong)."""
    import sky
    from sky.utils import common_utils, schemas

    common_utils.validate_schema(copy.deepcopy(config), schemas.get_task_schema(), "invalid task: ")
    return sky.Task.from_yaml_config(copy.deepcopy(config))


def summary(loaded) -> dict:
    """What SkyPilot made of a task (what it would launch), as JSON: its secrets by name only."""
    import yaml

    resources = loaded.resources if isinstance(loaded.resources, list) else sorted(loaded.resources, key=str)

    def one(r) -> dict:
        autostop = r.autostop_config
        return {
            "accelerators": r.accelerators,
            "cpus": r.cpus,
            "memory": r.memory,
            "use_spot": r.use_spot,
            "cloud": str(r.cloud) if r.cloud is not None else None,
            "region": r.region,
            "autostop": {"enabled": autostop.enabled, "idle_minutes": autostop.idle_minutes, "down": autostop.down}
            if autostop is not None
            else None,
        }

    return {
        "name": loaded.name,
        "num_nodes": loaded.num_nodes,
        "run": loaded.run,
        "setup": loaded.setup,
        "envs": dict(loaded.envs),
        "secrets": sorted(loaded.secrets),
        "file_mounts": loaded.file_mounts or {},
        "ordered": isinstance(loaded.resources, list),
        "resources": [one(r) for r in resources],
        "repr": repr(loaded),
        "stored": yaml.safe_dump(loaded.to_yaml_config(use_user_specified_yaml=True)),
    }


def request(call, *args, stream: bool = False, **kwargs):
    """Send one request, name it (its id), and wait for its result, relaying its log when `stream`."""
    from sky.client import sdk

    request_id = call(*args, **kwargs)
    say(request_id=request_id)
    return sdk.stream_and_get(request_id, output_stream=sys.stdout) if stream else sdk.get(request_id)


def hourly_cost(handle) -> float | None:
    try:
        return handle.launched_resources.get_cost(3600) * handle.launched_nodes
    except Exception:  # SkyPilot has no price for this infra or handle
        return None


def refresh_mode(refresh: bool):
    """FORCE asks the cloud (or Slurm) what became of the cluster; NONE reads SkyPilot's own table."""
    from sky.utils import common

    return common.StatusRefreshMode.FORCE if refresh else common.StatusRefreshMode.NONE


def run(op: str, args: dict):
    from sky.client import sdk

    if op == "validate":
        return summary(task(args["config"]))
    if op == "check_infra":
        resources = task(args["config"]).resources
        return {
            "enabled": [str(c) for c in request(sdk.enabled_clouds)],
            "wanted": sorted({str(r.cloud) for r in resources if r.cloud is not None}),
        }
    if op == "status":
        now = time.time()
        return [
            {
                "name": r["name"],
                "status": r["status"].value,
                "infra": f"{r.get('cloud') or '-'}{'/' + r['region'] if r.get('region') else ''}",
                "resources": r.get("resources_str") or "-",
                "accelerators": r.get("accelerators") or None,
                "uptime_s": now - r["launched_at"] if r.get("launched_at") else None,
                "hourly_cost": hourly_cost(r.get("handle")),
            }
            for r in request(sdk.status, args["names"], refresh=refresh_mode(args.get("refresh", False)))
        ]
    if op == "plan":  # what `sky launch` shows before it asks: SkyPilot's optimizer table, its prices
        from sky.utils import dag_utils

        request(sdk.optimize, dag_utils.convert_entrypoint_to_dag(task(args["config"])), stream=True)
        return None
    if op == "launch":
        job_id, handle = request(sdk.launch, task(args["config"]), cluster_name=args["cluster"], stream=True)
        resources = handle.launched_resources
        accelerator = (
            ", ".join(f"{k}:{v:g}" for k, v in resources.accelerators.items())
            if resources.accelerators
            else f"none ({resources.cpus or '?'} CPUs)"
        )
        return {"job_id": job_id, "hourly_cost": hourly_cost(handle), "accelerator": accelerator}
    if op == "exec":
        job_id, _ = request(sdk.exec, task(args["config"]), cluster_name=args["cluster"], stream=True)
        return {"job_id": job_id}
    if op == "queue":
        return [
            {"job_id": j["job_id"], "job_name": j["job_name"], "status": j["status"].value}
            for j in request(sdk.queue, args["cluster"], skip_finished=True)
        ]
    if op == "cancel":
        request(sdk.cancel, args["cluster"], job_ids=args["job_ids"])
        return None
    if op == "job_status":
        statuses = request(sdk.job_status, args["cluster"], job_ids=[args["job_id"]])
        status = statuses.get(args["job_id"]) or statuses.get(str(args["job_id"]))
        return status.value if status is not None else "UNKNOWN"
    if op == "api_cancel":
        request(sdk.api_cancel, args["request_id"], silent=True)
        return None
    if op == "tail_logs":
        sdk.tail_logs(args["cluster"], args["job_id"], follow=True, output_stream=sys.stdout)
        return None
    if op == "down":
        request(sdk.down, args["cluster"])
        return None
    raise ValueError(f"unknown operation {op!r}")


def main() -> None:
    from sky import exceptions

    op, args = sys.argv[1], json.loads(sys.stdin.read() or "{}")
    kinds = (
        (exceptions.ApiServerConnectionError, "api_server"),
        (exceptions.ResourcesUnavailableError, "resources"),
        (exceptions.NotSupportedError, "not_supported"),
        (exceptions.ClusterDoesNotExist, "no_cluster"),
        (ValueError, "invalid"),
    )
    try:
        result = run(op, args)
    except Exception as exc:
        kind = next((name for cls, name in kinds if isinstance(exc, cls)), "failed")
        say(error=kind, message=str(exc) or type(exc).__name__)
        sys.exit(1)
    say(result=result)


if __name__ == "__main__":
    main()
