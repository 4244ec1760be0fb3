#!/usr/bin/env bash
# The trainer's GPU run (issue 32) on a CUDA machine as it comes, set up as tests/gpu/run_gpu.sh sets it up (the
# carried wheels of tests/gpu/fetch_wheels.sh in .gpu-wheels/, this checkout's art-sky beside them): the CUDA check
# of packed micro-batches and the fused LM head against the plain computation in bf16 (tests/gpu/test_trainer_cuda.py),
# then for each shape bench/bench_trainer.py (equal lengths, mixed lengths with padded rows beside packed, and a
# torch.profiler summary of one step of each), bench/bench_steps.py (a step's wall split, checkpoint on the step's path
# against in the background) and bench/bench_sharded.py (FSDP2 on one rank against one process). Results (run.log:
# everything printed; a JSON per bench, the device named in each) go to $OUT when it is set, else gpu-results/; copy
# them into bench/results/. Usage, from anywhere in the checkout:
#   bash tests/gpu/run_trainer_bench.sh [SHAPE ...]      # default: qwen2-0.5b qwen2.5-7b (qwen2.5-14b: a run of its own)
# Budget: about 8 minutes on an H100 for the default shapes (the 7B model is built on the GPU and saved once).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -gt 0 ]; then SHAPES=("$@"); else SHAPES=(qwen2-0.5b qwen2.5-7b); fi
RESULTS="${OUT:-$PWD/gpu-results}"
SITE="$(mktemp -d)/site"
PYTHON="${PYTHON:-python3}"
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/run.log") 2>&1
ls .gpu-wheels/*.whl >/dev/null 2>&1 || { echo "no wheels in .gpu-wheels: run tests/gpu/fetch_wheels.sh first" >&2; exit 2; }
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu-wheels/*.whl
cp -r art_sky "$SITE/art_sky"
for folder in client cluster templates; do cp -r "$folder" "$SITE/art_sky/$folder"; done
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 ART_SKY_CACHE_DIR="${ART_SKY_CACHE_DIR:-$(mktemp -d)}"
"$PYTHON" -c "import sys, torch, transformers, peft; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| CUDA', torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__)"
"$PYTHON" -c "import torch.nn.attention.varlen" 2>/dev/null && echo "varlen flash attention: yes" \
  || echo "varlen flash attention: no (packed rows attend one sequence at a time)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
status=0
ART_SKY_GPU_SHAPE="${SHAPES[0]}" "$PYTHON" -P -m pytest tests/gpu/test_trainer_cuda.py -v -s -rs -p no:cacheprovider \
  || status=1
for shape in "${SHAPES[@]}"; do
  case "$shape" in  # the plain loop's full logits must fit too: smaller micro-batches for the larger shapes
    qwen2.5-14b) micro=2048 ;; qwen2.5-7b) micro=4096 ;; *) micro=8192 ;;
  esac
  "$PYTHON" bench/bench_trainer.py --shape "$shape" --rows 16 --length 1024 --prompt 256 --repeats 3 \
    --microbatch-tokens "$micro" --lora-rank 16 --json "$RESULTS/trainer-$shape.json" || status=1
  "$PYTHON" bench/bench_trainer.py --shape "$shape" --rows 16 --length 1024 --prompt 256 --repeats 3 --mixed \
    --microbatch-tokens "$micro" --lora-rank 16 --profile "$RESULTS/profile-$shape.txt" \
    --json "$RESULTS/trainer-mixed-$shape.json" || status=1
  "$PYTHON" bench/bench_steps.py --shape "$shape" --lora-rank 16 --steps 2 --json "$RESULTS/steps-$shape.json" \
    || status=1
done
"$PYTHON" bench/bench_sharded.py --shape "${SHAPES[-1]}" --ranks 1 --rows 16 --length 1024 --prompt 256 \
  --microbatch-tokens 4096 --json "$RESULTS/sharded-${SHAPES[-1]}.json" || status=1
echo "results in $RESULTS"
exit $status
