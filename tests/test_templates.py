"""Every task the code can render is valid for the real SkyPilot: its schema accepts it and it loads as a sky.Task
(in SkyPilot's own environment: what SkyPilot made of it comes back from sky_driver.py's summary)."""

from __future__ import annotations

import subprocess
from importlib import resources as package_files
from pathlib import Path

import pytest
import yaml
from pydantic import SecretStr, ValidationError

from art_sky.errors import ConfigError
from art_sky.provisioners.sky import validate
from art_sky.provisioners.sky_task import (
    ClusterSpec,
    load_template,
    parse_gpus,
    render_task,
    validate_task,
)

KEY = SecretStr("test-api-key-never-printed")
WHEEL = Path("/tmp/dist/art_sky-0.1.0-py3-none-any.whl")

VARIANTS = {
    "default GPU, shipped wheel": ClusterSpec(wheel=WHEEL),
    "fallback list, spot, region": ClusterSpec(
        gpu=["H100", "A100-80GB:1"], spot=True, infra="gcp/us-central1", version="0.1.0"
    ),
    "multi-GPU on kubernetes": ClusterSpec(
        gpu="A100:8", infra="k8s/my-context", wheel=WHEEL, resources={"disk_size": 512}
    ),
    "CPU on slurm, prepared python": ClusterSpec(
        gpu=None,
        infra="slurm/localcluster",
        python="/opt/venv/bin/python",
        resources={"cpus": 1, "memory": 1},
        autostop_minutes=None,
    ),
    "user env and overrides": ClusterSpec(
        wheel=WHEEL,
        env={"ART_SKY_ENGINE": "portable"},
        overrides={"resources": {"region": "us-east-1"}, "num_nodes": 1},
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_is_a_valid_skypilot_task(name, tmp_path):
    task = validate(validate_task(render_task(VARIANTS[name], KEY, tmp_path / "secrets.env")))
    assert task["name"] == "art-sky-server"
    assert task["run"] and task["setup"]


def test_shipped_templates_validate_as_they_are():
    """`sky launch templates/<x>.yaml` must work too: each shipped task YAML is valid once its secrets are set (the
    GitHub workflow, a `.yml`, is not a task: tests/test_ci_run.py checks it)."""
    names = [f.name for f in package_files.files("art_sky.templates").iterdir() if f.name.endswith(".yaml")]
    assert {"cluster.yaml", "ci-job.yaml"} <= set(names)
    for name in names:
        config = yaml.safe_load((package_files.files("art_sky.templates") / name).read_text())
        config["secrets"] = {k: "x" for k in config.get("secrets") or {}}
        validate_task(config)


def test_gpu_fallback_list_keeps_its_order_and_spot_applies_to_each(tmp_path):
    task = validate(render_task(VARIANTS["fallback list, spot, region"], KEY, tmp_path / "secrets.env"))
    assert task["ordered"]  # `ordered`: tried first to last
    assert [list(r["accelerators"]) for r in task["resources"]] == [["H100"], ["A100-80GB"]]
    assert all(r["use_spot"] and r["cloud"] == "GCP" and r["region"] == "us-central1" for r in task["resources"])


def test_one_gpu_gets_a_count_and_the_gpu_extra(tmp_path):
    config = render_task(ClusterSpec(gpu="L4", wheel=WHEEL), KEY, tmp_path / "secrets.env")
    task = validate(config)
    (resources,) = task["resources"]
    assert resources["accelerators"] == {"L4": 1}
    assert task["envs"]["ART_SKY_EXTRA"] == "gpu"
    assert config["resources"]["disk_size"] == 256


def test_a_multi_gpu_node_keeps_its_count(tmp_path):
    """`--gpu H100:8` / initialize_cluster(gpu="H100:8"): the count reaches SkyPilot, alone or in a fallback list
    (the server splits the node's GPUs itself: cluster/node/placement.py)."""
    (resources,) = validate(
        render_task(ClusterSpec(gpu=parse_gpus(["H100:8"]), wheel=WHEEL), KEY, tmp_path / "secrets.env")
    )["resources"]
    assert resources["accelerators"] == {"H100": 8}
    task = validate(
        render_task(ClusterSpec(gpu=parse_gpus(["H100:8,A100-80GB:8"]), wheel=WHEEL), KEY, tmp_path / "secrets.env")
    )
    assert [r["accelerators"] for r in task["resources"]] == [{"H100": 8}, {"A100-80GB": 8}]


def test_cpu_only_installs_the_cluster_extra_and_skips_install_with_a_prepared_python(tmp_path):
    config = render_task(VARIANTS["CPU on slurm, prepared python"], KEY, tmp_path / "secrets.env")
    task = validate(config)
    (resources,) = task["resources"]
    assert resources["accelerators"] is None and resources["cpus"] == "1" and resources["memory"] == "1"
    assert task["envs"]["ART_SKY_EXTRA"] == "cluster"
    assert task["envs"]["ART_SKY_PYTHON"] == "/opt/venv/bin/python"
    assert "autostop" not in config["resources"] and list(task["file_mounts"]) == ["~/art-sky/secrets.env"]  # no wheel


def test_autostop_tears_down(tmp_path):
    config = render_task(ClusterSpec(wheel=WHEEL, autostop_minutes=15), KEY, tmp_path / "secrets.env")
    (resources,) = validate(config)["resources"]
    assert resources["autostop"] == {"enabled": True, "idle_minutes": 15, "down": True}


def test_the_shipped_wheel_is_mounted_where_setup_installs_it(tmp_path):
    config = render_task(ClusterSpec(wheel=WHEEL), KEY, tmp_path / "secrets.env")
    task = validate(config)
    assert task["file_mounts"][f"~/art-sky/dist/{WHEEL.name}"] == str(WHEEL)
    assert task["envs"]["ART_SKY_WHEEL"] == WHEEL.name
    assert "$HOME/art-sky/dist/$ART_SKY_WHEEL" in task["setup"]


def test_the_secrets_travel_in_a_file_only_its_owner_reads(tmp_path):
    """Not as SkyPilot task secrets, which the node shows in command lines, shell history and its job file
    (tests/test_skypilot.py checks the node): a 0600 file mount that the run script sources."""
    store_key = "store-secret-'quoted' $HOME `x`"
    spec = ClusterSpec(wheel=WHEEL, secrets={"AWS_SECRET_ACCESS_KEY": store_key})
    config = render_task(spec, KEY, tmp_path / "secrets.env")
    task = validate(config)
    for shown in (str(task["envs"]), task["repr"], task["stored"], str(config)):
        assert KEY.get_secret_value() not in shown and store_key not in shown
    assert task["secrets"] == [] and task["file_mounts"]["~/art-sky/secrets.env"] == str(tmp_path / "secrets.env")
    assert (tmp_path / "secrets.env").stat().st_mode & 0o777 == 0o600
    sourced = subprocess.run(  # what the template's run script does with it
        [
            "bash",
            "-c",
            f'set -a; . "{tmp_path}/secrets.env"; set +a; printf "%s\\n%s" "$ART_SKY_API_KEY" "$AWS_SECRET_ACCESS_KEY"',
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert sourced.stdout == f"{KEY.get_secret_value()}\n{store_key}"
    assert "set -a; . ~/art-sky/secrets.env; set +a" in config["run"]


def test_a_secret_whose_name_is_no_variable_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="environment variable names .*fix BAD-NAME"):
        render_task(ClusterSpec(wheel=WHEEL, secrets={"BAD-NAME": "x"}), KEY, tmp_path / "secrets.env")


def test_overrides_merge_replace_and_delete(tmp_path):
    spec = ClusterSpec(
        wheel=WHEEL,
        overrides={"resources": {"disk_size": 100, "autostop": None}, "envs": {"HF_HOME": "/data/hf"}, "workdir": None},
    )
    config = render_task(spec, KEY, tmp_path / "secrets.env")
    assert config["resources"]["disk_size"] == 100 and "autostop" not in config["resources"]
    assert config["resources"]["accelerators"] == "H100:1"
    assert config["envs"]["HF_HOME"] == "/data/hf" and config["envs"]["ART_SKY_EXTRA"] == "gpu"
    validate_task(config)


def test_a_user_template_is_rendered_the_same_way(tmp_path):
    template = tmp_path / "mine.yaml"
    template.write_text("name: my-server\nresources:\n  cpus: 4+\nrun: echo mine\n")
    config = render_task(ClusterSpec(template=template, gpu=None, version="0.1.0"), KEY, tmp_path / "secrets.env")
    task = validate(config)
    assert task["name"] == "my-server" and task["run"] == "echo mine"
    assert task["envs"]["ART_SKY_VERSION"] == "0.1.0" and "~/art-sky/secrets.env" in task["file_mounts"]


def test_an_invalid_override_names_the_field_and_hides_the_key(tmp_path):
    with pytest.raises(ConfigError, match="disk_sise") as error:
        validate_task(render_task(ClusterSpec(wheel=WHEEL, resources={"disk_sise": 10}), KEY, tmp_path / "secrets.env"))
    assert KEY.get_secret_value() not in str(error.value)


def test_nothing_to_install_is_refused_with_what_to_give(tmp_path):
    with pytest.raises(ConfigError, match="wheel, an art-sky version, or a prepared Python"):
        render_task(ClusterSpec(), KEY, tmp_path / "secrets.env")


def test_an_empty_fallback_list_is_refused():
    with pytest.raises(ValidationError, match="empty GPU list"):
        ClusterSpec(gpu=[])


def test_a_missing_template_says_which(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_template(tmp_path / "nope.yaml")


def test_several_nodes_are_one_skypilot_task_whose_head_serves_and_the_others_join(tmp_path):
    """num_nodes reaches SkyPilot; the run script starts the server on node 0 (also on its private address, at
    the head port) and has every other node join it there."""
    config = render_task(ClusterSpec(gpu="H100:8", num_nodes=2, wheel=WHEEL), KEY, tmp_path / "secrets.env")
    task = validate(validate_task(config))
    assert task["num_nodes"] == 2
    assert '--host 127.0.0.1 --host "$head" --port "$ART_SKY_HEAD_PORT"' in config["run"]
    assert '--join "http://$head:$ART_SKY_HEAD_PORT" --node-rank "$SKYPILOT_NODE_RANK"' in config["run"]
    assert 'export ART_SKY_NODES="$nodes"' in config["run"]  # its bound
    assert "num_nodes" not in render_task(ClusterSpec(gpu="H100:8", wheel=WHEEL), KEY, tmp_path / "secrets.env")


def test_fewer_than_one_node_is_refused():
    with pytest.raises(ValueError, match="num_nodes"):
        ClusterSpec(gpu="H100:8", num_nodes=0, wheel=WHEEL)
