# Sourced by scripts/install.sh and scripts/install-vllm.sh: which locked set of versions
# (requirements/, written by scripts/lock) this machine takes, pip's arguments for it, and the check
# that what is installed is that set.

# lock_select [auto|cpu|cuda|gpu]: sets lock_mode (cpu or cuda; auto: cuda when nvidia-smi sees a GPU),
# lock_file and lock_args (pip's arguments: the constraints, and PyTorch's CPU index when it is needed)
lock_select() {
  local mode="${1:-auto}" torch
  [ "$mode" = gpu ] && mode=cuda
  if [ "$mode" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then mode=cuda; else mode=cpu; fi
  fi
  case "$mode" in
    cpu | cuda) ;;
    *) echo "locked: unknown set '$mode' (cpu, cuda or gpu)" >&2; return 2 ;;
  esac
  lock_mode="$mode"
  lock_file="requirements/$mode.txt"
  lock_args=(-c "$lock_file")
  if [ "$mode" = cpu ]; then
    # torch's CPU build (X+cpu) is served by PyTorch's index, not PyPI: add that index unless pip
    # already finds the build (installed, or in a configured mirror or wheel directory)
    torch="$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$lock_file")"
    if ! pip install --dry-run --no-deps --quiet "torch==$torch" >/dev/null 2>&1; then
      lock_args+=(--extra-index-url "${ECHO2_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
    fi
  fi
}

# lock_verify: exits nonzero, naming each one, when an installed package the lock names has another
# version than the lock's (so an install that drifted off the tested set says so at once)
lock_verify() {
  python - "$lock_file" <<'PY'
import importlib.metadata as md
import re
import sys


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


locked = {}
for line in open(sys.argv[1]):
    m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line)
    if m:
        locked[norm(m[1])] = m[2]
installed = {norm(d.metadata["Name"]): d.version for d in md.distributions()}
off = sorted(f"{n} {v} (locked {locked[n]})" for n, v in installed.items() if n in locked and v != locked[n])
if off:
    sys.exit(f"locked: installed versions differ from {sys.argv[1]}: " + ", ".join(off))
print(f"locked: {sum(n in locked for n in installed)} installed packages, each at its version in {sys.argv[1]}")
PY
}
