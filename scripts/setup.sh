#!/usr/bin/env bash
# Installs everything rljob's tests and demo need on a fresh Debian machine (idempotent):
# Debian packages (redis-server, iproute2, util-linux), the Python package with its trainer and test
# extras, and the Go-built control plane + helm (cached under ~/.cache/rljob/tools by version).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v unshare >/dev/null || need_apt+=(util-linux)
command -v openssl >/dev/null || need_apt+=(openssl)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

echo "setup: pip install -e .[trainer,test]"
python3 -m pip install -q --disable-pip-version-check -e '.[trainer,test]'

if [ -x localcluster/build-go-tools.sh ]; then
  echo "setup: Go tools (control plane, kubectl, helm)"
  localcluster/build-go-tools.sh
fi
