#!/usr/bin/env bash
# The wheels tests/gpu/run_gpu.sh needs on a lent CUDA machine, fetched here (where PyPI is reachable) into
# .gpu-wheels/ (git-ignored), to be carried there. That machine's image has Python 3.12, torch, transformers, peft,
# accelerate, httpx, jinja2, pytest, ... but not the server's web stack (fastapi, uvicorn, pydantic) nor art-sky's
# client dependencies (openai, paramiko, obstore); nothing can be downloaded there. These are their wheels for
# cp312 manylinux x86_64, at the versions the tested GPU stack pins (templates/gpu-constraints.txt), less what the
# image already has. Usage: bash tests/gpu/fetch_wheels.sh [PYTHON_VERSION]   (default 3.12; 3.11 to rehearse here)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY_VERSION="${1:-3.12}"
DEST=.gpu-wheels
PIP="${PYTHON:-python3} -m pip"
# What art-sky's server, the GPU tests and the benchmarks import beyond the image (their dependencies follow).
WANTED=(fastapi uvicorn aiohttp llguidance pydantic-settings python-dotenv openai paramiko obstore pytest-asyncio)
# Already on the image (the device's KINDS.md lists them): carrying them would shadow its own.
PRESENT=" annotated-doc anyio certifi charset-normalizer click colorama h11 httpcore httpx idna iniconfig jinja2
 markdown-it-py markupsafe mdurl numpy packaging pluggy psutil pygments pytest pyyaml requests rich shellingham
 tqdm typer typing-extensions urllib3 "
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)
TARGET=(--only-binary=:all: --implementation cp --python-version "$PY_VERSION" "${PLATFORMS[@]}")
report=$(mktemp)
trap 'rm -f "$report"' EXIT
$PIP install --quiet --dry-run --ignore-installed --target "$(mktemp -d)" "${TARGET[@]}" \
  -c templates/gpu-constraints.txt --report "$report" "${WANTED[@]}" 2>/dev/null
mapfile -t needed < <(python3 - "$report" "$PRESENT" <<'PY'
import json, sys
present = set(sys.argv[2].split())
for item in json.load(open(sys.argv[1]))["install"]:
    name = item["metadata"]["name"].lower().replace("_", "-")
    if name not in present:
        print(f"{name}=={item['metadata']['version']}")
PY
)
rm -rf "$DEST" && mkdir -p "$DEST"
$PIP download --quiet --no-deps --dest "$DEST" "${TARGET[@]}" "${needed[@]}" 2>/dev/null
echo "$(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1), in $DEST for Python $PY_VERSION:"
ls "$DEST"
