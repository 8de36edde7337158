#!/usr/bin/env bash
# Runs the e2e suite against a kind cluster on a host with Docker (cannot run on machines without a
# container engine). Builds the operator and CPU trainer images from the project's Dockerfiles, and the operator
# image of the commit the upgrade test starts from (tests/e2e/upgrade-from) from that commit's Dockerfile, loads
# them into kind, installs the chart and runs `pytest -m e2e --cluster=existing`.
#
#   tests/e2e/kind/run.sh            # create cluster "rljob", build, load, install, test, keep the cluster
#   KEEP_CLUSTER=0 tests/e2e/kind/run.sh   # delete the cluster at the end
set -euo pipefail
cd "$(dirname "$0")/../../.."

CLUSTER=${CLUSTER:-rljob}
VERSION=$(python3 -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
OPERATOR_IMAGE=rljob/operator:${VERSION}
TRAINER_IMAGE=rljob/trainer-cpu:${VERSION}
UPGRADE_FROM=$(git rev-parse --verify "$(grep -v '^#' tests/e2e/upgrade-from | head -1)^{commit}")
EARLIER_SRC=$(localcluster/build-release.sh --source-only "$UPGRADE_FROM" | tail -1)/src
EARLIER_VERSION=$(python3 -c 'import sys,tomllib;print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' \
  "$EARLIER_SRC/pyproject.toml")
EARLIER_IMAGE=rljob/operator:${EARLIER_VERSION}-${UPGRADE_FROM:0:12}

command -v kind >/dev/null || { echo "kind is not installed: https://kind.sigs.k8s.io" >&2; exit 2; }
command -v docker >/dev/null || { echo "docker is not installed" >&2; exit 2; }

kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --config tests/e2e/kind/kind-config.yaml
docker build -t "$OPERATOR_IMAGE" -f Dockerfile .
docker build -t "$TRAINER_IMAGE" -f trainer_image/Dockerfile.cpu .
docker build -t "$EARLIER_IMAGE" -f "$EARLIER_SRC/Dockerfile" "$EARLIER_SRC"
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$TRAINER_IMAGE" "$EARLIER_IMAGE"

export KUBECONFIG=${KUBECONFIG:-$(mktemp)}
kind get kubeconfig --name "$CLUSTER" > "$KUBECONFIG"
bash scripts/install-dev.sh test
python3 -m pytest -m e2e --cluster=existing --operator-image="$OPERATOR_IMAGE" \
  --earlier-operator-image="$EARLIER_IMAGE" -q tests/e2e
status=$?
[ "${KEEP_CLUSTER:-1}" = 1 ] || kind delete cluster --name "$CLUSTER"
exit $status
