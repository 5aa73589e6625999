#!/usr/bin/env bash
# Install echo2 (editable) with its development extra into the active environment, every package at
# the version of the locked, tested set (requirements/, written by scripts/lock; docs/install.md):
#
#   bash scripts/install.sh          # cuda when nvidia-smi sees a GPU, cpu otherwise
#   bash scripts/install.sh cpu      # requirements/cpu.txt: torch's CPU build (from PyTorch's CPU index)
#   bash scripts/install.sh cuda     # requirements/cuda.txt: torch's CUDA build (from PyPI)
#
# Ends by checking that every installed package the lock names is at the locked version.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/locked.sh

lock_select "${1:-auto}"
echo "install: the $lock_mode set ($lock_file)"
pip install "${lock_args[@]}" -e ".[dev]"
lock_verify
