#!/usr/bin/env bash
# The development install: every distribution of the tree editable (api, wire, trainer, rollout, operator,
# localcluster: one per folder, each with its own dependencies) and the root's extras, test by default.
#
#   scripts/install-dev.sh                 # what the tests need
#   scripts/install-dev.sh test,benchmark  # and the learning benchmarks' (TRL, matplotlib, psutil)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
python3 -m pip install -q --disable-pip-version-check \
  -e ./api -e ./wire -e ./trainer -e ./rollout -e ./operator -e ./localcluster -e ".[$extras]"
