#!/usr/bin/env bash
# build-images.sh — builds every container image the local cluster needs, from the project's own
# Dockerfiles, with buildah (daemonless, a Debian package), and exports each as an OCI archive that
# `ctr -n k8s.io images import` loads under the name kubelet and the operator ask for:
#
#   operator     Dockerfile                          docker.io/rljob/operator:<version>
#   trainer-cpu  trainer_image/Dockerfile.cpu        docker.io/rljob/trainer-cpu:<version>
#   redis        localcluster/images/redis/Dockerfile docker.io/library/redis:7.2   (Debian redis-server; a stand-in)
#   pause        localcluster/images/pause/          registry.k8s.io/pause:3.10.1   (our static pause.c)
#
# (<version> from pyproject.toml). No registry is reachable, so the Python images start FROM a locally made
# base (localcluster/images/base/make-rootfs.sh: debootstrap bookworm + python3 + pip, the build host's CA
# certificates and pip settings), passed as the PYTHON_IMAGE build argument: the Dockerfiles stay the ones a
# user builds with docker. torch comes from RLJOB_TORCH_INDEX_URL (default here: PyPI, the CUDA build — the
# PyTorch CPU index, the Dockerfile's default, is unreachable here).
#
# Caching: every image is keyed by a hash of its inputs — its Dockerfile, every file its COPY lines read
# (git ls-files of those paths, tracked + untracked-not-ignored: exactly the build context handed to buildah),
# its build arguments and the base's hash. Archives live in
#
#   ${RLJOB_IMAGES_DIR:-$HOME/.cache/rljob/images}/<name>-<hash>.tar     + index.json
#
# and an image whose archive for the current hash exists is not rebuilt (a run with nothing changed takes
# seconds). Within a rebuild, buildah's layer cache (--layers) keeps the torch and dependency layers of the
# trainer image when only sources changed, and the Dockerfiles' `RUN --mount=type=cache,target=/root/.cache/pip`
# is a directory kept between builds (RLJOB_PIP_CACHE) holding the trainer's wheelhouse, so torch is downloaded
# once per machine. buildah's storage: ${RLJOB_BUILDAH_DIR:-$HOME/.cache/rljob/buildah}.
#
# index.json: {"images": [{"name": "docker.io/rljob/operator:0.1.0", "key": "operator", "archive": "/abs.tar",
#              "hash": "<sha256 of the inputs>", "bytes": <archive size>, "unpacked_bytes": <image size>}, ...]}
# Its path is the LAST line printed on stdout (all progress goes to stderr).
#
# Usage: build-images.sh [--only NAME]... [--force] [--list] [--prune]
#   --only NAME   build only NAME (base, operator, trainer-cpu, redis, pause); repeatable. index.json still
#                 lists every image whose archive for its current hash exists.
#   --force       rebuild the selected images even if cached (the base too when it is selected: no
#                 --only, or --only base)
#   --list        print "name image hash cached|missing" for every image and exit (no build)
#   --prune       afterwards remove stale archives and buildah images/layers no current image uses
# Env:
#   RLJOB_IMAGES_DIR        archives + index.json (default $HOME/.cache/rljob/images)
#   RLJOB_BUILDAH_DIR       buildah storage, build contexts, temp files (default $HOME/.cache/rljob/buildah)
#   RLJOB_TORCH_INDEX_URL   torch's index (default https://pypi.org/simple)
#   RLJOB_DEBIAN_MIRROR     Debian mirror for the base (default: the host's apt mirror, else deb.debian.org)
#   RLJOB_PIP_CACHE         pip cache + wheelhouse of the builds (default $HOME/.cache/rljob/pip)
#   RLJOB_EXTRA_CA_DIR      CA certificates (*.crt) for the base (default /usr/local/share/ca-certificates)
#   RLJOB_IMAGES_QUIET=1    say nothing about cached images
#   RLJOB_SOURCE_DIR        the source tree whose Dockerfiles and files are built (default: the repository
#                           holding this script); the base is always this script's (localcluster/images/base),
#                           so an earlier commit's tree (build-release.sh) shares the base and its layers
#   RLJOB_IMAGE_TAG         the tag of rljob/operator and rljob/trainer-cpu (default: the version in the source
#                           tree's pyproject.toml); build-release.sh tags an earlier commit's images <version>-<commit>
# Needs root, buildah, debootstrap (base), gcc + static libc (pause), flock, sha256sum; git for the hash.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${RLJOB_SOURCE_DIR:-$HERE/..}" && pwd)"
IMAGES_DIR="${RLJOB_IMAGES_DIR:-${HOME:-/root}/.cache/rljob/images}"
BUILDAH_DIR="${RLJOB_BUILDAH_DIR:-${HOME:-/root}/.cache/rljob/buildah}"
TORCH_INDEX_URL="${RLJOB_TORCH_INDEX_URL:-https://pypi.org/simple}"
# Bump to rebuild everything (the way images are assembled changed without an input changing).
RECIPE_VERSION=1

BASE_NAME=localhost/rljob-base/python:3.11-bookworm
# The sandbox image: kubelet v1.34 takes it from the CRI runtime (its --pod-infra-container-image is
# deprecated and has no default); kubeadm v1.34 and the upstream release pin pause 3.10.1, so containerd's
# `sandbox_image` must be set to exactly this name.
PAUSE_NAME=registry.k8s.io/pause:3.10.1
REDIS_NAME=docker.io/library/redis:7.2
ALL=(base operator trainer-cpu redis pause)

log() { echo "[build-images] $*" >&2; }
quiet_log() { [[ "${RLJOB_IMAGES_QUIET:-0}" == 1 ]] || log "$@"; }
die() { echo "[build-images] ERROR: $*" >&2; exit 1; }

ONLY=() FORCE=0 LIST=0 PRUNE=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) [[ $# -ge 2 ]] || die "--only needs a name"; ONLY+=("$2"); shift 2;;
    --only=*) ONLY+=("${1#--only=}"); shift;;
    --force) FORCE=1; shift;;
    --list) LIST=1; shift;;
    --prune) PRUNE=1; shift;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 0;;
    *) die "unknown argument '$1' (see --help)";;
  esac
done
for n in "${ONLY[@]}"; do
  [[ " ${ALL[*]} " == *" $n "* ]] || die "unknown image '$n' (${ALL[*]})"
done
selected() { [[ ${#ONLY[@]} -eq 0 || " ${ONLY[*]} " == *" $1 "* ]]; }

VERSION="$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$REPO/pyproject.toml" | head -1)"
[[ -n "$VERSION" ]] || die "no version in $REPO/pyproject.toml"
TAG="${RLJOB_IMAGE_TAG:-$VERSION}"
[[ "$TAG" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "RLJOB_IMAGE_TAG '$TAG' is not a valid image tag"

image_name() { # <key>
  case "$1" in
    base) echo "$BASE_NAME";;
    operator) echo "docker.io/rljob/operator:$TAG";;
    trainer-cpu) echo "docker.io/rljob/trainer-cpu:$TAG";;
    redis) echo "$REDIS_NAME";;
    pause) echo "$PAUSE_NAME";;
  esac
}

# ---------------------------------------------------------------------------------------------- hashing
sha() { sha256sum | cut -d' ' -f1; }

# Files under the given repo paths, as the build context sees them: tracked + untracked-not-ignored
# (no __pycache__, egg-info, ...), existing regular files or symlinks, NUL-separated, sorted.
context_files() { # <path>...
  if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard -- "$@") |
      (cd "$REPO" && while IFS= read -r -d '' f; do
        [[ -f "$f" || -L "$f" ]] && printf '%s\0' "$f"; done) | sort -zu
  else
    (cd "$REPO" && find "$@" \( -name __pycache__ -o -name '*.egg-info' -o -name .pytest_cache \
      -o -name .hypothesis -o -name build \) -prune -o \( -type f -o -type l \) -print0) | sort -zu
  fi
}

# "mode sha256  path" per file: content, exec bit and name all count (symlinks by their target's content).
files_digest() { # reads NUL-separated paths relative to $REPO on stdin
  local list; list="$(mktemp)"
  cat > "$list"
  if [[ -s "$list" ]]; then
    (cd "$REPO" && paste -d' ' <(xargs -0 stat -L -c %a < "$list") <(xargs -0 sha256sum < "$list"))
  fi
  rm -f "$list"
}

# Sources of the COPY/ADD lines of a Dockerfile that read the build context (no --from).
copy_sources() { # <dockerfile>
  awk '
    /^[[:space:]]*#/ { next }
    { line = cont $0; cont = "" }
    line ~ /\\[[:space:]]*$/ { sub(/\\[[:space:]]*$/, " ", line); cont = line; next }
    {
      $0 = line
      if (toupper($1) != "COPY" && toupper($1) != "ADD") next
      srcs = ""; from = 0
      for (i = 2; i < NF; i++) {
        if ($i ~ /^--from/) from = 1
        if ($i ~ /^--/) continue
        if ($i ~ /^\[/) { print "build-images: JSON-form COPY is not supported: " line > "/dev/stderr"; exit 3 }
        srcs = srcs $i "\n"
      }
      if (!from) printf "%s", srcs
    }' "$1"
}

# The host's pip settings the base's /etc/pip.conf carries (what the host's pip needs to reach its index).
pip_conf_text() {
  local key val
  echo "# The build host's pip settings (localcluster/build-images.sh); this base image is local only."
  echo "[global]"
  echo "cert = /etc/ssl/certs/ca-certificates.crt"
  echo "disable-pip-version-check = true"
  for key in index-url extra-index-url trusted-host timeout; do
    val=""
    case "$key" in
      index-url) val="${PIP_INDEX_URL:-}";;
      extra-index-url) val="${PIP_EXTRA_INDEX_URL:-}";;
      trusted-host) val="${PIP_TRUSTED_HOST:-}";;
      timeout) val="${PIP_DEFAULT_TIMEOUT:-${PIP_TIMEOUT:-}}";;
    esac
    if [[ -z "$val" ]] && command -v python3 >/dev/null; then
      val="$(python3 -m pip config get "global.$key" 2>/dev/null || true)"
      [[ -n "$val" || "$key" != timeout ]] || val="$(python3 -m pip config get "global.default-timeout" 2>/dev/null || true)"
    fi
    [[ -z "$val" ]] || echo "$key = $val"
  done
}

debian_mirror() {
  if [[ -n "${RLJOB_DEBIAN_MIRROR:-}" ]]; then echo "$RLJOB_DEBIAN_MIRROR"; return; fi
  local m=""
  m="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
    awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i ~ /\/debian\/?$/) { print $i; exit } }')" || true
  if [[ -z "$m" ]]; then
    m="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
      awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\/.*\/debian\/?$/) { print $i; exit } }')" || true
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

CA_DIR="${RLJOB_EXTRA_CA_DIR:-/usr/local/share/ca-certificates}"
MIRROR="$(debian_mirror)"
PIP_CONF_TEXT="$(pip_conf_text)"
declare -A HASH=()

hash_base() {
  {
    echo "recipe $RECIPE_VERSION base"
    sha256sum < "$HERE/images/base/make-rootfs.sh"
    echo "mirror $MIRROR"
    printf '%s\n' "$PIP_CONF_TEXT" | sha256sum
    if [[ -d "$CA_DIR" ]]; then
      find "$CA_DIR" -type f -name '*.crt' -print0 | sort -z | xargs -0 -r sha256sum | cut -d' ' -f1
    fi
  } | sha
}

# <key> <dockerfile (repo-relative)> <context kind: repo|dir> <build args...>
hash_dockerfile_image() {
  local key="$1" df="$2"; shift 2
  local srcs=() s
  while IFS= read -r s; do [[ -n "$s" ]] && srcs+=("${s%/}"); done < <(copy_sources "$REPO/$df")
  {
    echo "recipe $RECIPE_VERSION $key $(image_name "$key")"
    echo "dockerfile $(sha256sum < "$REPO/$df" | cut -d' ' -f1)"
    printf 'arg %s\n' "$@"
    if [[ ${#srcs[@]} -gt 0 ]]; then context_files "${srcs[@]}" | files_digest; fi
  } | sha
}

pause_compile_id() { # the compiler and libc that the static binary embeds
  { gcc --version 2>/dev/null | head -1; ldd --version 2>/dev/null | head -1; } || true
}

compute_hashes() {
  HASH[base]="$(hash_base)"
  HASH[operator]="$(hash_dockerfile_image operator Dockerfile "PYTHON_IMAGE=$BASE_NAME@${HASH[base]}")"
  HASH[trainer-cpu]="$(hash_dockerfile_image trainer-cpu trainer_image/Dockerfile.cpu \
    "PYTHON_IMAGE=$BASE_NAME@${HASH[base]}" "TORCH_INDEX_URL=$TORCH_INDEX_URL")"
  HASH[redis]="$(hash_dockerfile_image redis localcluster/images/redis/Dockerfile "BASE_IMAGE=$BASE_NAME@${HASH[base]}")"
  HASH[pause]="$({
    echo "recipe $RECIPE_VERSION pause $PAUSE_NAME"
    sha256sum < "$HERE/images/pause/pause.c"; sha256sum < "$HERE/images/pause/Dockerfile"
    pause_compile_id
  } | sha)"
}

archive_path() { echo "$IMAGES_DIR/$1-${HASH[$1]:0:16}.tar"; }
is_cached() { # <key>
  if [[ "$1" == base ]]; then
    [[ "$(bah_label "$BASE_NAME")" == "${HASH[base]}" ]]
  else
    [[ -f "$(archive_path "$1")" && -f "$(archive_path "$1").json" ]]
  fi
}

# ---------------------------------------------------------------------------------------------- buildah
RUNROOT="/run/rljob-buildah"
bah() {
  TMPDIR="$BUILDAH_DIR/tmp" buildah --root "$BUILDAH_DIR/storage" --runroot "$RUNROOT" \
    --storage-driver overlay "$@"
}
bah_label() { # <image> -> its io.rljob.inputs-hash label, or nothing
  bah inspect --type image --format '{{index .OCIv1.Config.Labels "io.rljob.inputs-hash"}}' "$1" 2>/dev/null || true
}

check_prereqs() {
  [[ "$(id -u)" == 0 ]] || die "needs root (buildah with overlay storage, debootstrap, chroot)"
  local missing=() c
  for c in buildah flock sha256sum tar; do command -v "$c" >/dev/null || missing+=("$c"); done
  [[ ${#missing[@]} -eq 0 ]] || die "missing: ${missing[*]} (apt-get install buildah util-linux coreutils tar)"
}

# The pip cache the Dockerfiles' `RUN --mount=type=cache,target=/root/.cache/pip` see. buildah 1.28 (as root)
# keeps cache mounts at $TMPDIR/buildah-cache/<target>; that directory is made a symlink to
# RLJOB_PIP_CACHE (default ~/.cache/rljob/pip). The trainer's Dockerfile keeps a wheelhouse there, so torch is
# downloaded once per machine: pip's own HTTP cache does not help on machines whose proxy strips caching
# headers (this one). RLJOB_PIP_CACHE="$(pip cache dir)" shares the host's pip cache instead.
setup_pip_cache() {
  local cache="${RLJOB_PIP_CACHE:-${HOME:-/root}/.cache/rljob/pip}"
  mkdir -p "$cache"
  local parent="$BUILDAH_DIR/tmp/buildah-cache/root/.cache"
  mkdir -p "$parent"
  if [[ -d "$parent/pip" && ! -L "$parent/pip" ]]; then
    # a cache buildah made itself: keep what it holds
    cp -a "$parent/pip/." "$cache/" 2>/dev/null || true
    rm -rf "$parent/pip"
  fi
  ln -sfn "$cache" "$parent/pip"
  quiet_log "pip cache of the builds: $cache"
}

# ---------------------------------------------------------------------------------------------- builders
build_base() {
  local work="$BUILDAH_DIR/work/base" start=$SECONDS
  command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
  rm -rf "$work"; mkdir -p "$work"
  printf '%s\n' "$PIP_CONF_TEXT" > "$work/pip.conf"
  log "base: making a Debian bookworm rootfs (debootstrap, about a minute or two)"
  "$HERE/images/base/make-rootfs.sh" --mirror "$MIRROR" --pip-conf "$work/pip.conf" --ca-dir "$CA_DIR" \
    "$work/rootfs" || die "base rootfs failed"
  local c; c="$(bah from --pull-never scratch)"
  local mnt; mnt="$(bah mount "$c")"
  tar -C "$work/rootfs" --numeric-owner --xattrs --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
    -cf - . | tar -C "$mnt" --numeric-owner --xattrs -xpf -
  bah umount "$c" >/dev/null
  bah config --os linux --arch amd64 \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd '["python3"]' \
    --label "io.rljob.inputs-hash=${HASH[base]}" \
    --label "org.opencontainers.image.description=Local stand-in for python:3.11-slim-bookworm (debootstrap minbase + Debian python3/pip, the build host's CA certificates and pip settings); localcluster/images/base/make-rootfs.sh" \
    "$c"
  bah commit --rm --quiet "$c" "$BASE_NAME" >/dev/null
  rm -rf "$work"
  # Images and layer caches built on the previous base can never be reused: free their space (the torch
  # layer alone is 5 GiB). Tagged images stay until their own rebuild replaces them.
  bah rmi --prune >/dev/null 2>&1 || true
  log "base: $BASE_NAME ready in $((SECONDS - start))s"
}

# Copy exactly the hashed files into a fresh context directory.
make_context() { # <dir> <path>...
  local dir="$1"; shift
  rm -rf "$dir"; mkdir -p "$dir"
  [[ $# -gt 0 ]] || return 0
  context_files "$@" | (cd "$REPO" && tar --null -T - -cf -) | tar -C "$dir" -xf -
}

# <key> <dockerfile> <context dir> <layers: true|false> <build-arg...>
bud() {
  local key="$1" df="$2" ctx="$3" layers="$4"; shift 4
  local args=() a
  for a in "$@"; do args+=(--build-arg "$a"); done
  bah bud --network host --layers="$layers" --pull-never --format oci \
    --label "io.rljob.inputs-hash=${HASH[$key]}" \
    "${args[@]}" -f "$df" -t "$(image_name "$key")" "$ctx" >&2 ||
    die "$key: buildah bud -f ${df#"$REPO"/} failed (see above)"
}

build_dockerfile_image() { # <key> <dockerfile> <layers> <build-arg...>
  local key="$1" df="$2" layers="$3"; shift 3
  local srcs=() s
  while IFS= read -r s; do [[ -n "$s" ]] && srcs+=("${s%/}"); done < <(copy_sources "$REPO/$df")
  local ctx="$BUILDAH_DIR/ctx/$key"
  make_context "$ctx" "${srcs[@]}"
  bud "$key" "$REPO/$df" "$ctx" "$layers" "$@"
  rm -rf "$ctx"
}

build_pause() {
  command -v gcc >/dev/null || die "gcc not found (apt-get install gcc libc6-dev)"
  local ctx="$BUILDAH_DIR/ctx/pause"
  rm -rf "$ctx"; mkdir -p "$ctx"
  gcc -static -Os -Wall -Werror -DPAUSE_VERSION="\"3.10.1-rljob\"" -o "$ctx/pause" "$HERE/images/pause/pause.c" ||
    die "pause: gcc -static failed (needs libc6-dev's static libc)"
  strip "$ctx/pause" 2>/dev/null || true
  bud pause "$HERE/images/pause/Dockerfile" "$ctx" false
  rm -rf "$ctx"
}

export_archive() { # <key>
  local key="$1" name; name="$(image_name "$key")"
  local out; out="$(archive_path "$key")"
  local tmp="$out.tmp.$$" start=$SECONDS
  rm -f "$tmp"
  log "$key: exporting $name -> $out"
  # zstd layers: about 1.6 min for the trainer here (gzip: 2-3 min, and larger); containerd >= 1.5 unpacks them.
  bah push --quiet --format oci --compression-format zstd "$name" "oci-archive:$tmp:$name" >&2 ||
    die "$key: buildah push failed"
  mv -f "$tmp" "$out"
  local bytes unpacked
  bytes="$(stat -c %s "$out")"
  unpacked="$(unpacked_bytes "$name")"
  printf '{"key": "%s", "name": "%s", "archive": "%s", "hash": "%s", "bytes": %s, "unpacked_bytes": %s}\n' \
    "$key" "$name" "$out" "${HASH[$key]}" "$bytes" "${unpacked:-0}" > "$out.json.tmp"
  mv -f "$out.json.tmp" "$out.json"
  # Older archives of this image (other hashes) are stale.
  local f; for f in "$IMAGES_DIR/$key"-*.tar; do
    [[ "$f" == "$out" || ! -e "$f" ]] || rm -f "$f" "$f.json"
  done
  log "$key: archive $(du -h "$out" | cut -f1) ($((SECONDS - start))s)"
}

# Sum of the uncompressed sizes of an image's layers (what a node's containerd unpacks), from buildah's
# storage metadata (containers/storage overlay-images/images.json + overlay-layers/layers.json).
unpacked_bytes() { # <image name>
  python3 - "$BUILDAH_DIR/storage" "$1" <<'PY' 2>/dev/null || echo 0
import json, sys
root, name = sys.argv[1], sys.argv[2]
images = json.load(open(f"{root}/overlay-images/images.json"))
layers = {l["id"]: l for l in json.load(open(f"{root}/overlay-layers/layers.json"))}
top = next(i["layer"] for i in images if name in i.get("names", []))
total = 0
while top:
    total += layers[top].get("diff-size", 0)
    top = layers[top].get("parent")
print(total)
PY
}

build() { # <key>
  local key="$1" start=$SECONDS
  log "$key: building $(image_name "$key") (inputs ${HASH[$key]:0:16})"
  case "$key" in
    base) build_base; return;;
    operator) build_dockerfile_image operator Dockerfile false "PYTHON_IMAGE=$BASE_NAME";;
    trainer-cpu) build_dockerfile_image trainer-cpu trainer_image/Dockerfile.cpu true \
      "PYTHON_IMAGE=$BASE_NAME" "TORCH_INDEX_URL=$TORCH_INDEX_URL";;
    redis) build_dockerfile_image redis localcluster/images/redis/Dockerfile false "BASE_IMAGE=$BASE_NAME";;
    pause) build_pause;;
  esac
  export_archive "$key"
  log "$key: done in $((SECONDS - start))s"
}

write_index() {
  local idx="$IMAGES_DIR/index.json" key first=1
  {
    echo '{"images": ['
    for key in operator trainer-cpu redis pause; do
      local meta; meta="$(archive_path "$key").json"
      if [[ -f "$meta" && -f "$(archive_path "$key")" ]]; then
        [[ $first == 1 ]] || echo ','
        printf '  %s' "$(cat "$meta")"; first=0
      elif selected "$key"; then
        log "WARNING: $key ($(image_name "$key")) has no archive for its current inputs; not in the index"
      fi
    done
    echo ''
    echo ']}'
  } > "$idx.tmp"
  mv -f "$idx.tmp" "$idx"
  echo "$idx"
}

prune() {
  log "prune: stale archives and unused buildah images"
  local key f
  for key in operator trainer-cpu redis pause; do
    for f in "$IMAGES_DIR/$key"-*.tar; do
      [[ ! -e "$f" || "$f" == "$(archive_path "$key")" ]] || rm -f "$f" "$f.json"
    done
  done
  rm -f "$IMAGES_DIR"/*.tmp.* 2>/dev/null || true
  bah rmi --prune >/dev/null 2>&1 || true
}

# ---------------------------------------------------------------------------------------------- main
# (a function, called on the last line: bash parses it whole, so editing this file mid-build is safe)
main() {
  check_prereqs
  mkdir -p "$IMAGES_DIR" "$BUILDAH_DIR/tmp" "$BUILDAH_DIR/storage"
  compute_hashes

  if [[ $LIST == 1 ]]; then
    for key in "${ALL[@]}"; do
      if is_cached "$key"; then st=cached; else st=missing; fi
      printf '%-12s %-45s %s %s\n' "$key" "$(image_name "$key")" "${HASH[$key]:0:16}" "$st"
    done
    exit 0
  fi

  # One builder at a time per cache root (tests, the CLI and CI may all ask at once).
  exec 9>"$IMAGES_DIR/.lock"
  if ! flock -n 9; then
    log "another build holds $IMAGES_DIR/.lock; waiting for it"
    flock 9
    compute_hashes   # the tree may have changed while we waited; the other build may have done our work
  fi

  # ... and one builder per buildah dir (two image dirs may share it): its ctx/, work/ and containers are ours.
  exec 8>"$BUILDAH_DIR/.lock"
  if ! flock -n 8; then
    log "another build uses $BUILDAH_DIR; waiting for it"
    flock 8
  fi
  # Working containers a failed build left (build_base mounts one between `from` and `commit`): the storage
  # root is this script's own and both locks are held, so every container in it is a dead build's.
  bah rm --all >/dev/null 2>&1 || true
  rm -rf "$BUILDAH_DIR"/ctx "$BUILDAH_DIR"/work "$IMAGES_DIR"/*.tmp.* 2>/dev/null || true
  find "$BUILDAH_DIR/tmp" -mindepth 1 -maxdepth 1 -not -name 'buildah-cache*' -exec rm -rf {} + 2>/dev/null || true
  setup_pip_cache

  total=$SECONDS
  # What to build: the selected images, plus the base when a selected Dockerfile image must be built and the
  # base is not there (it is never exported; it only has to exist in buildah's storage).
  todo=()
  for key in operator trainer-cpu redis pause; do
    selected "$key" || continue
    if [[ $FORCE == 1 ]] || ! is_cached "$key"; then todo+=("$key"); else quiet_log "cached: $key $(image_name "$key")"; fi
  done
  need_base=0
  if selected base && { [[ $FORCE == 1 ]] || ! is_cached base; }; then need_base=1; fi
  for key in "${todo[@]}"; do [[ "$key" == pause ]] || { is_cached base || need_base=1; }; done
  if [[ $need_base == 1 ]]; then build base; else quiet_log "cached: base $BASE_NAME"; fi
  for key in "${todo[@]}"; do build "$key"; done
  [[ $PRUNE == 0 ]] || prune
  [[ ${#todo[@]} -eq 0 && $need_base == 0 ]] || log "all done in $((SECONDS - total))s"
  write_index
}

main "$@"
