#!/usr/bin/env bash
# The README's test command: set up a fresh machine, then run the default suite (the end-to-end jobs on
# the local cluster included). Extra arguments go to pytest (e.g. -m "not e2e" for the quick part).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec python3 -m pytest -q "$@"
