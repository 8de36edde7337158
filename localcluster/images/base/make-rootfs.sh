#!/usr/bin/env bash
# make-rootfs.sh — the recipe of the local Python base image (a stand-in for python:3.11-slim-bookworm).
#
#   make-rootfs.sh --mirror URL --pip-conf FILE [--ca-dir DIR] ROOTFS_DIR
#
# Makes a Debian bookworm root filesystem with debootstrap --variant=minbase plus python3, pip and
# ca-certificates, shaped like the python:*-slim images as far as our Dockerfiles can tell:
#   - `python`, `python3`, `pip`, `pip3` on PATH; pip installs system-wide (EXTERNALLY-MANAGED removed),
#   - useradd/groupadd (passwd), bash, apt (so derived images can apt-get install),
#   - no apt lists, no docs/man/locales (dpkg excludes them for later installs too, as Debian's slim images do).
# The build host's site CA certificates (--ca-dir, e.g. a TLS-intercepting proxy's CA in
# /usr/local/share/ca-certificates) go into the image's trust store and --pip-conf becomes /etc/pip.conf,
# so pip inside `buildah bud` reaches the index the way the host's pip does. That host-specific part lives
# only in this local base, never in the project's Dockerfiles.
#
# Called by localcluster/build-images.sh, which caches the result by a hash of this file and its inputs.
# Needs root, debootstrap and the Debian mirror. Progress goes to stderr.
set -euo pipefail

SUITE=bookworm
PACKAGES=python3,python3-pip,python-is-python3,ca-certificates

log() { echo "[make-rootfs] $*" >&2; }
die() { echo "[make-rootfs] ERROR: $*" >&2; exit 1; }

MIRROR="" PIP_CONF="" CA_DIR="" ROOT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --mirror) MIRROR="$2"; shift 2;;
    --pip-conf) PIP_CONF="$2"; shift 2;;
    --ca-dir) CA_DIR="$2"; shift 2;;
    -*) die "unknown option $1";;
    *) ROOT="$1"; shift;;
  esac
done
[[ -n "$MIRROR" && -n "$PIP_CONF" && -n "$ROOT" ]] || die "usage: make-rootfs.sh --mirror URL --pip-conf FILE [--ca-dir DIR] ROOTFS_DIR"
[[ "$(id -u)" == 0 ]] || die "needs root (debootstrap, chroot)"
command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
[[ ! -e "$ROOT" ]] || die "$ROOT exists"

cleanup() { # debootstrap and chroot steps mount proc/sys/dev under the target; never leave them behind
  local m
  for m in $(findmnt -rn -o TARGET | grep -F "$ROOT/" | sort -r); do umount -l "$m" 2>/dev/null || true; done
}
trap cleanup EXIT

log "debootstrap --variant=minbase $SUITE from $MIRROR (+ $PACKAGES)"
if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" > "$ROOT.debootstrap.log" 2>&1; then
  tail -n 30 "$ROOT.debootstrap.log" >&2
  die "debootstrap failed (log: $ROOT.debootstrap.log; the mirror must be reachable)"
fi

in_root() { chroot "$ROOT" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"; }

# apt sources like the Debian images (main, updates, security) on the host's mirror.
security="${MIRROR%/}"
if [[ "$security" == */debian ]]; then security="${security}-security"; else security="http://deb.debian.org/debian-security"; fi
rm -f "$ROOT/etc/apt/sources.list"
cat > "$ROOT/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: ${MIRROR%/}
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF

# Slim like debian:*-slim: no docs, man pages or translations, now or in later apt-get installs.
cat > "$ROOT/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
cat > "$ROOT/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
cat > "$ROOT/etc/apt/apt.conf.d/docker-no-recommends" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
EOF
find "$ROOT/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
find "$ROOT/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* "$ROOT"/usr/share/lintian "$ROOT"/usr/share/linda
find "$ROOT/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} + 2>/dev/null || true

# Site CA certificates of the build host (e.g. a TLS-intercepting proxy) into the image's trust store.
if [[ -n "$CA_DIR" && -d "$CA_DIR" ]]; then
  n=0
  while IFS= read -r -d '' f; do
    install -D -m 0644 "$f" "$ROOT/usr/local/share/ca-certificates/build-host/$(basename "$f")"; n=$((n + 1))
  done < <(find "$CA_DIR" -type f -name '*.crt' -print0 | sort -z)
  log "added $n build-host CA certificate(s) from $CA_DIR"
fi
in_root update-ca-certificates --fresh >/dev/null

# pip: system-wide installs like python:*-slim, the host's pip settings (CA bundle, index, timeout).
rm -f "$ROOT"/usr/lib/python3*/EXTERNALLY-MANAGED
install -m 0644 "$PIP_CONF" "$ROOT/etc/pip.conf"

# No host identity, no caches.
: > "$ROOT/etc/resolv.conf"
: > "$ROOT/etc/hostname"
: > "$ROOT/etc/machine-id" 2>/dev/null || true
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/* "$ROOT"/var/cache/debconf/*-old \
  "$ROOT"/var/log/* "$ROOT"/tmp/* "$ROOT"/root/.cache

in_root python --version >&2
in_root pip --version >&2
in_root sh -c 'command -v useradd groupadd >/dev/null' || die "useradd/groupadd missing"
log "rootfs ready: $(du -sh "$ROOT" | cut -f1)"
