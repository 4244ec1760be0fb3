#!/usr/bin/env bash
# The GPU run on a CUDA machine as it comes (Python 3.12, torch, transformers, peft, accelerate; no network, no
# vLLM, Unsloth or fastapi): installs the carried wheels of tests/gpu/fetch_wheels.sh (.gpu-wheels/) into a
# target folder, puts this checkout's art-sky beside them, and runs the GPU tests and the benchmarks on models
# built from a config with random weights. Results (run.log: everything printed; a JSON per benchmark) go to $OUT
# when it is set, else to gpu-results/. Usage, from anywhere in the checkout:
#   bash tests/gpu/run_gpu.sh [SHAPE ...]     # default: qwen2-0.5b qwen2-1.5b
# Rehearse it on a CPU with ART_SKY_GPU_RUN_ON_CPU=1 and the shape tiny (wheels fetched for this Python).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -gt 0 ]; then SHAPES=("$@"); else SHAPES=(qwen2-0.5b qwen2-1.5b); fi
RESULTS="${OUT:-$PWD/gpu-results}"
SITE="$(mktemp -d)/site"
PYTHON="${PYTHON:-python3}"
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/run.log") 2>&1
ls .gpu-wheels/*.whl >/dev/null 2>&1 || { echo "no wheels in .gpu-wheels: run tests/gpu/fetch_wheels.sh first" >&2; exit 2; }
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu-wheels/*.whl
# art-sky as its wheel lays it out (client/, cluster/ and templates/ under art_sky), from this checkout.
cp -r art_sky "$SITE/art_sky"
for folder in client cluster templates; do cp -r "$folder" "$SITE/art_sky/$folder"; done
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 ART_SKY_CACHE_DIR="${ART_SKY_CACHE_DIR:-$(mktemp -d)}"
"$PYTHON" -c "import sys, torch, transformers, peft; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| CUDA', torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
status=0
ART_SKY_GPU_SHAPE="${SHAPES[0]}" ART_SKY_GPU_RESULTS="$RESULTS/steps-${SHAPES[0]}.json" \
  "$PYTHON" -P -m pytest tests/gpu -v -s -rs -p no:cacheprovider || status=1  # -P: art_sky from $SITE, not the checkout
for shape in "${SHAPES[@]}"; do
  "$PYTHON" bench/bench_trainer.py --shape "$shape" --rows 16 --length 1024 --prompt 256 --repeats 5 \
    --microbatch-tokens 8192 --json "$RESULTS/trainer-$shape.json" || status=1
  "$PYTHON" bench/bench_portable_engine.py --shape "$shape" --json "$RESULTS/engine-$shape.json" || status=1
  "$PYTHON" bench/bench_sharded.py --shape "$shape" --rows 16 --length 1024 --prompt 256 --microbatch-tokens 8192 \
    --json "$RESULTS/sharded-$shape.json" || status=1
done
echo "results in $RESULTS"
exit $status
