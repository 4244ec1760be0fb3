#!/usr/bin/env bash
# The GPU smoke test on a CUDA host: vLLM serves, Unsloth trains, a few GRPO steps, the adapter reloaded; prints
# wall times and tokens/s. Usage, from anywhere in the checkout:
#   bash tests/gpu/run_gpu_smoke.sh /path/to/small-chat-model   # a local Hugging Face model directory
# Makes .venv-gpu (art-sky[gpu,dev]: vllm + unsloth) on first use, then runs tests/gpu with output shown.
set -euo pipefail
MODEL_DIR="${1:?usage: run_gpu_smoke.sh /path/to/local/model/dir (e.g. Qwen2.5-0.5B-Instruct)}"
[ -f "$MODEL_DIR/config.json" ] || { echo "$MODEL_DIR has no config.json: give a Hugging Face model directory" >&2; exit 2; }
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "no NVIDIA GPU here" >&2; exit 2; }
VENV=.venv-gpu
if ! "$VENV/bin/python" -c "import vllm, unsloth" 2>/dev/null; then
  python -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c templates/gpu-constraints.txt -e ".[gpu,dev]"  # the tested GPU stack
fi
"$VENV/bin/python" -m pip install -q --no-deps -e .
ART_SKY_GPU_MODEL="$(cd "$MODEL_DIR" && pwd)" "$VENV/bin/python" -m pytest tests/gpu -s -v -rs
