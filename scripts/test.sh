#!/usr/bin/env bash
# The README's test command: set up a fresh machine, then run the whole default suite (e2e included).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec python3 -m pytest -q "$@"
