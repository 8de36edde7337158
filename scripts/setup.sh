#!/usr/bin/env bash
# Installs everything rljob's tests and demo need on a fresh Debian machine (idempotent):
# Debian packages (redis-server, iproute2, util-linux; containerd, runc, the CNI plugins, iptables and
# conntrack for the local cluster's nodes; buildah and debootstrap for its images), rljob's distributions
# (scripts/install-dev.sh: editable, with the test extra), a venv with vLLM's CPU build (scripts/vllm-venv.sh), the Go-built control plane, node components, helm and Kueue (cached under
# ~/.cache/rljob/tools by version), and the images built from the project's Dockerfiles (cached under
# ~/.cache/rljob/images by a hash of their inputs), and the operator image of the commit the e2e upgrade test
# starts from (tests/e2e/upgrade-from; ~/.cache/rljob/releases, by commit).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v unshare >/dev/null || need_apt+=(util-linux)
command -v openssl >/dev/null || need_apt+=(openssl)
command -v containerd >/dev/null || need_apt+=(containerd)
command -v runc >/dev/null || need_apt+=(runc)
[ -x /usr/lib/cni/bridge ] || need_apt+=(containernetworking-plugins)
command -v iptables >/dev/null || need_apt+=(iptables)
command -v conntrack >/dev/null || need_apt+=(conntrack)
command -v buildah >/dev/null || need_apt+=(buildah)
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
[ -x /bin/busybox ] || need_apt+=(busybox-static)
command -v gcc >/dev/null || need_apt+=(gcc)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || need_apt+=(libc6-dev)
command -v git >/dev/null || need_apt+=(git)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

echo "setup: scripts/install-dev.sh (every distribution editable, with the test extra)"
bash scripts/install-dev.sh test

echo "setup: the vLLM venv of the vllm backend's tests (scripts/vllm-venv.sh; cached by its inputs)"
bash scripts/vllm-venv.sh >/dev/null

if [ -x localcluster/build-go-tools.sh ]; then
  echo "setup: Go tools (control plane, node components, kubectl, helm, Kueue)"
  localcluster/build-go-tools.sh
fi

if [ -x localcluster/build-images.sh ]; then
  echo "setup: images (operator, CPU trainer, Redis, pause) from the project's Dockerfiles"
  localcluster/build-images.sh >/dev/null
fi

if [ -x localcluster/build-release.sh ]; then
  echo "setup: the earlier operator the upgrade test starts from (tests/e2e/upgrade-from)"
  localcluster/build-release.sh "$(grep -v '^#' tests/e2e/upgrade-from | head -1)" >/dev/null
fi
