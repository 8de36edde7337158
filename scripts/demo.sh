#!/usr/bin/env bash
# The README's main job: set up a fresh machine (scripts/setup.sh), then start the local Kubernetes cluster,
# install the operator with helm, apply examples/rljob-cpu.yaml and watch it train to Succeeded.
# Extra arguments go to `python -m rljob_localcluster demo`, e.g. `scripts/demo.sh --down` to stop the
# cluster at the end (by default it keeps running; `python3 -m rljob_localcluster down` stops it).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec python3 -m rljob_localcluster demo "$@"
