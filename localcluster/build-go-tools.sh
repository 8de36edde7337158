#!/usr/bin/env bash
# build-go-tools.sh — the project's one build script for every Go tool the local
# test cluster needs:
#
#   kubernetes  kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, kube-proxy
#               (k8s.io/kubernetes, wrapper module localcluster/gotools/kubernetes)
#   etcd        etcd server (go.etcd.io/etcd/server/v3, wrapper module localcluster/gotools/etcd)
#   helm        helm v3 (helm.sh/helm/v3/cmd/helm, wrapper module localcluster/gotools/helm)
#   coredns     CoreDNS, the cluster DNS of the local nodes (github.com/coredns/coredns with the
#               plugins the local Corefile uses; wrapper module localcluster/gotools/coredns,
#               whose main.go is the command)
#   kueue       Kueue's manager (sigs.k8s.io/kueue/cmd/kueue, wrapper module localcluster/gotools/kueue),
#               with the manifests it needs copied from the same module version next to the
#               binary: config/components/crd/bases/*.yaml -> <cache>/kueue-<version>/crds/ and
#               config/components/webhook/manifests.yaml -> <cache>/kueue-<version>/webhooks.yaml
#               (read by rljob_localcluster.kueue; go.sum pins their bytes like the code's)
#
# Versions are pinned by the committed go.mod/go.sum of each wrapper module (the
# only place to change them). Binaries are cached OUTSIDE the repository, keyed
# by version:
#
#   ${RLJOB_TOOLS_DIR:-$HOME/.cache/rljob/tools}/<tool>-<version>/<binary>
#
# and a directory of symlinks to the whole pinned set is (re)made at
#
#   ${RLJOB_TOOLS_DIR:-$HOME/.cache/rljob/tools}/bin-<hash of the pinned versions>/
#
# whose path is the LAST line printed on stdout (all progress goes to stderr), so
#
#   export PATH="$(localcluster/build-go-tools.sh):$PATH"
#
# works. With the cache present a run returns in well under a second. A cold
# build takes tens of minutes on 2 cores (kube-apiserver dominates).
#
# Usage: build-go-tools.sh [--versions] [TOOL...]     (TOOL: kubernetes etcd helm coredns kueue; default all)
#   --versions   print "tool version" lines for the pinned set and exit
# Env:
#   RLJOB_TOOLS_DIR         cache root (default $HOME/.cache/rljob/tools)
#   RLJOB_GO_BUILD_P        go build -p (default: number of CPUs)
#   RLJOB_FORCE_REBUILD=1   rebuild even if cached
#   RLJOB_TOOLS_QUIET=1     say nothing about tools already cached (builds still report progress)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GOTOOLS="$HERE/gotools"
TOOLS_DIR="${RLJOB_TOOLS_DIR:-${HOME:-/root}/.cache/rljob/tools}"

log() { echo "[build-go-tools] $*" >&2; }
quiet_log() { [[ "${RLJOB_TOOLS_QUIET:-0}" == 1 ]] || log "$@"; }
die() { echo "[build-go-tools] ERROR: $*" >&2; exit 1; }

# Version of a required module, read from a wrapper go.mod (no go toolchain needed).
modver() { # <go.mod> <module path>
  awk -v m="$2" '
    /^replace/ { inrep=1 } inrep && /^\)/ { inrep=0; next } inrep { next }
    { for (i = 1; i < NF; i++) if ($i == m && $(i+1) ~ /^v[0-9]/) { print $(i+1); exit } }' "$1"
}

K8S_VERSION="$(modver "$GOTOOLS/kubernetes/go.mod" k8s.io/kubernetes)"
ETCD_VERSION="$(modver "$GOTOOLS/etcd/go.mod" go.etcd.io/etcd/server/v3)"
HELM_VERSION="$(modver "$GOTOOLS/helm/go.mod" helm.sh/helm/v3)"
COREDNS_VERSION="$(modver "$GOTOOLS/coredns/go.mod" github.com/coredns/coredns)"
KUEUE_VERSION="$(modver "$GOTOOLS/kueue/go.mod" sigs.k8s.io/kueue)"
[[ -n "$K8S_VERSION" && -n "$ETCD_VERSION" && -n "$HELM_VERSION" && -n "$COREDNS_VERSION" && -n "$KUEUE_VERSION" ]] ||
  die "could not read pinned versions from $GOTOOLS/*/go.mod"

if [[ "${1:-}" == "--versions" ]]; then
  printf 'kubernetes %s\netcd %s\nhelm %s\ncoredns %s\nkueue %s\n' "$K8S_VERSION" "$ETCD_VERSION" "$HELM_VERSION" \
    "$COREDNS_VERSION" "$KUEUE_VERSION"
  exit 0
fi

K8S_DIR="$TOOLS_DIR/kubernetes-$K8S_VERSION"
ETCD_DIR="$TOOLS_DIR/etcd-$ETCD_VERSION"
HELM_DIR="$TOOLS_DIR/helm-$HELM_VERSION"
COREDNS_DIR="$TOOLS_DIR/coredns-$COREDNS_VERSION"
KUEUE_DIR="$TOOLS_DIR/kueue-$KUEUE_VERSION"
K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)

have_all() { # <dir> <file>...   (binaries must be executable, *.yaml files only present)
  local d="$1"; shift
  [[ -f "$d/.complete" ]] || return 1
  local b; for b in "$@"; do
    if [[ "$b" == *.yaml ]]; then [[ -f "$d/$b" ]] || return 1; else [[ -x "$d/$b" ]] || return 1; fi
  done
}

find_go() {
  if command -v go >/dev/null 2>&1; then command -v go; return; fi
  local g; for g in /usr/local/go/bin/go "$HOME/go/bin/go" /usr/lib/go/bin/go; do
    [[ -x "$g" ]] && { echo "$g"; return; }
  done
  die "no Go toolchain found (need go >= 1.24 on PATH; the Go module proxy must be reachable)"
}

go_env_setup() {
  GO="$(find_go)"
  export CGO_ENABLED=0
  # -trimpath: reproducible binaries, no local paths. -mod=readonly: go.sum is the pin.
  export GOFLAGS="-trimpath -mod=readonly -buildvcs=false"
  GOP="${RLJOB_GO_BUILD_P:-$(nproc 2>/dev/null || echo 2)}"
  log "using $("$GO" version) (-p $GOP), cache root $TOOLS_DIR"
}

# Commit time of a module version as recorded by the module proxy (for a reproducible buildDate).
mod_time() { # <wrapper dir> <module>
  (cd "$1" && "$GO" list -m -f '{{if .Time}}{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}{{end}}' "$2" 2>/dev/null) ||
    true
}

# Build the given packages of a wrapper module into a temp dir (then run the
# function named by $STAGE_EXTRA, if any, with that dir: more files to cache),
# move the results into the cache dir and mark it complete.
STAGE_EXTRA=""
build_into() { # <wrapper dir> <dest dir> <ldflags> <pkg>...
  local wrapper="$1" dest="$2" ldflags="$3"; shift 3
  local tmp; tmp="$(mktemp -d "$TOOLS_DIR/.build.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  local start=$SECONDS
  log "building $(basename "$dest"): $*"
  (cd "$wrapper" && "$GO" build -p "$GOP" -ldflags "$ldflags" -o "$tmp/" "$@") ||
    die "go build failed for $(basename "$dest")"
  if [[ -n "$STAGE_EXTRA" ]]; then "$STAGE_EXTRA" "$tmp"; fi
  mkdir -p "$dest"
  local f; for f in "$tmp"/*; do rm -rf "${dest:?}/$(basename "$f")"; mv -f "$f" "$dest/"; done
  date -u +%Y-%m-%dT%H:%M:%SZ > "$dest/.complete"
  log "built $(basename "$dest") in $((SECONDS - start))s -> $dest"
}

build_kubernetes() {
  local v="${K8S_VERSION#v}" major minor
  major="${v%%.*}"; minor="${v#*.}"; minor="${minor%%.*}"
  local date; date="$(mod_time "$GOTOOLS/kubernetes" k8s.io/kubernetes)"
  [[ -n "$date" ]] || date="1970-01-01T00:00:00Z"
  local ld="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    # The module proxy does not carry the git commit; record the module version instead.
    ld+=" -X $pkg.gitCommit=module-k8s.io/kubernetes@$K8S_VERSION -X $pkg.gitTreeState=clean"
    ld+=" -X $pkg.buildDate=$date"
  done
  local pkgs=(); local b; for b in "${K8S_BINS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  build_into "$GOTOOLS/kubernetes" "$K8S_DIR" "$ld" "${pkgs[@]}"
}

build_etcd() {
  local ld="-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module-$ETCD_VERSION"
  build_into "$GOTOOLS/etcd" "$ETCD_DIR" "$ld" go.etcd.io/etcd/server/v3
  # The main package is go.etcd.io/etcd/server/v3, so 'go build' names the binary "server".
  local n; for n in server v3; do
    if [[ -x "$ETCD_DIR/$n" ]]; then mv -f "$ETCD_DIR/$n" "$ETCD_DIR/etcd"; fi
  done
  [[ -x "$ETCD_DIR/etcd" ]] || die "etcd binary missing after build"
}

build_helm() {
  local ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  ld+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  # helm's Makefile sets its default Kubernetes capabilities from its client-go minor version.
  local cg; cg="$(modver "$GOTOOLS/helm/go.mod" k8s.io/client-go)"; cg="${cg#v0.}"; cg="${cg%%.*}"
  if [[ -n "$cg" ]]; then
    local p; for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
      ld+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$cg"
    done
  fi
  build_into "$GOTOOLS/helm" "$HELM_DIR" "$ld" helm.sh/helm/v3/cmd/helm
}

build_coredns() {
  # The command is the wrapper's own main package (a plugin subset); its binary is named "coredns".
  local ld="-s -w -X github.com/coredns/coredns/coremain.GitCommit=module-$COREDNS_VERSION"
  build_into "$GOTOOLS/coredns" "$COREDNS_DIR" "$ld" rljob.local/gotools/coredns
  [[ -x "$COREDNS_DIR/coredns" ]] || die "coredns binary missing after build"
}

# Kueue's manifests of exactly the pinned module version (the module cache holds the
# source 'go build' just compiled, verified against go.sum).
stage_kueue_manifests() { # <staging dir>
  local src; src="$(cd "$GOTOOLS/kueue" && "$GO" list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
  [[ -d "$src/config/components/crd/bases" ]] || die "no config/components/crd/bases in $src"
  mkdir -p "$1/crds"
  cp "$src"/config/components/crd/bases/*.yaml "$1/crds/"
  cp "$src/config/components/webhook/manifests.yaml" "$1/webhooks.yaml"
  chmod -R u+w "$1/crds" "$1/webhooks.yaml"   # the module cache is read-only
}

build_kueue() {
  local date; date="$(mod_time "$GOTOOLS/kueue" sigs.k8s.io/kueue)"
  [[ -n "$date" ]] || date="1970-01-01T00:00:00Z"
  local p=sigs.k8s.io/kueue/pkg/version
  local ld="-s -w -X $p.GitVersion=$KUEUE_VERSION -X $p.GitCommit=module-$KUEUE_VERSION -X $p.BuildDate=$date"
  STAGE_EXTRA=stage_kueue_manifests build_into "$GOTOOLS/kueue" "$KUEUE_DIR" "$ld" sigs.k8s.io/kueue/cmd/kueue
  [[ -x "$KUEUE_DIR/kueue" && -f "$KUEUE_DIR/webhooks.yaml" ]] || die "kueue binary or manifests missing after build"
}

want=("$@"); [[ ${#want[@]} -gt 0 ]] || want=(kubernetes etcd helm coredns kueue)
for t in "${want[@]}"; do
  case "$t" in kubernetes|etcd|helm|coredns|kueue) ;;
    *) die "unknown tool '$t' (kubernetes, etcd, helm, coredns, kueue)";; esac
done

mkdir -p "$TOOLS_DIR"
# One builder at a time per cache root (tests, the CLI and CI may all ask at once).
exec 9>"$TOOLS_DIR/.lock"
if ! flock -n 9; then
  log "another build holds $TOOLS_DIR/.lock; waiting for it"
  flock 9
fi

rm -rf "$TOOLS_DIR"/.build.* 2>/dev/null || true   # leftovers of an interrupted build
GO=""
need() { [[ -n "$GO" ]] || go_env_setup; }
for t in "${want[@]}"; do
  case "$t" in
    kubernetes) d="$K8S_DIR"; bins=("${K8S_BINS[@]}");;
    etcd)       d="$ETCD_DIR"; bins=(etcd);;
    helm)       d="$HELM_DIR"; bins=(helm);;
    coredns)    d="$COREDNS_DIR"; bins=(coredns);;
    kueue)      d="$KUEUE_DIR"; bins=(kueue webhooks.yaml crds/kueue.x-k8s.io_workloads.yaml);;
  esac
  if [[ "${RLJOB_FORCE_REBUILD:-0}" != "1" ]] && have_all "$d" "${bins[@]}"; then
    quiet_log "cached: $d"
    continue
  fi
  need
  "build_$t"
done

# A bin dir of symlinks for exactly this pinned set.
set_key="$(printf 'kubernetes-%s etcd-%s helm-%s coredns-%s kueue-%s' "$K8S_VERSION" "$ETCD_VERSION" \
  "$HELM_VERSION" "$COREDNS_VERSION" "$KUEUE_VERSION" | sha256sum | cut -c1-12)"
BIN_DIR="$TOOLS_DIR/bin-$set_key"
mkdir -p "$BIN_DIR"
link() { [[ -x "$1/$2" ]] && ln -sfn "$1/$2" "$BIN_DIR/$2"; return 0; }
for b in "${K8S_BINS[@]}"; do link "$K8S_DIR" "$b"; done
link "$ETCD_DIR" etcd
link "$HELM_DIR" helm
link "$COREDNS_DIR" coredns
link "$KUEUE_DIR" kueue
printf 'kubernetes %s\netcd %s\nhelm %s\ncoredns %s\nkueue %s\n' "$K8S_VERSION" "$ETCD_VERSION" "$HELM_VERSION" \
  "$COREDNS_VERSION" "$KUEUE_VERSION" > "$BIN_DIR/VERSIONS"
quiet_log "bin dir (kubernetes $K8S_VERSION, etcd $ETCD_VERSION, helm $HELM_VERSION, coredns $COREDNS_VERSION, kueue $KUEUE_VERSION):"
echo "$BIN_DIR"
