#!/usr/bin/env bash
# build-release.sh — an earlier version of rljob, as a user had it installed: one commit's source tree (its Helm
# chart, CRD and examples) and its operator image, built from that commit's Dockerfile with build-images.sh.
# The e2e upgrade test (tests/e2e/test_upgrade.py) installs it, then upgrades to the checkout's version.
#
#   ${RLJOB_RELEASES_DIR:-$HOME/.cache/rljob/releases}/<commit, 12 hex>/
#     src/                    `git archive <commit>` (helm/rljob-operator with its crds/, examples/, ...)
#     images/index.json       its operator image, docker.io/rljob/operator:<its version>-<commit, 12 hex>
#
# The image gets its own tag because an earlier commit usually carries the same version as the checkout (the tag
# rljob/operator:<version> is the current build's); the test installs the earlier chart with that tag. Only the
# operator is built: the earlier version's trainer/rollout pods run the checkout's trainer image, which the job names
# (the CPU trainer image is 2.9 GiB and unpacks to 6.3 GiB in each node; the upgrade replaces the operator only).
#
# Caching: the tree is extracted once per commit; the image is build-images.sh's, keyed by the hash of its inputs
# (that commit's Dockerfile and files, the base of this checkout's build-images.sh), so a run with both present takes
# seconds. The base image and the pip cache are shared with the checkout's own images.
#
# Usage: build-release.sh [--source-only] COMMIT
#   prints the release directory as the last stdout line (progress on stderr); --source-only: the tree, no image
#   (a cluster that builds its images otherwise: tests/e2e/kind/run.sh)
# Needs the commit in this clone's history (CI's clean clone has it; a shallow clone needs `git fetch --unshallow`),
# and what build-images.sh needs.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"

log() { echo "[build-release] $*" >&2; }
die() { echo "[build-release] ERROR: $*" >&2; exit 1; }

SOURCE_ONLY=0
if [[ "${1:-}" == --source-only ]]; then SOURCE_ONLY=1; shift; fi
[[ $# -eq 1 && -n "$1" && "$1" != -* ]] || die "usage: build-release.sh [--source-only] COMMIT"
SHA="$(git -C "$REPO" rev-parse --verify --quiet "$1^{commit}")" ||
  die "commit '$1' is not in the history of $REPO (a shallow clone? git fetch --unshallow)"
SHORT="${SHA:0:12}"
DIR="${RLJOB_RELEASES_DIR:-${HOME:-/root}/.cache/rljob/releases}/$SHORT"
mkdir -p "$DIR"

# One extractor per release dir (the test and setup.sh may both ask).
exec 9>"$DIR/.lock"
flock 9

if [[ ! -f "$DIR/src/.commit" ]]; then
  log "extracting $SHA into $DIR/src"
  rm -rf "$DIR/src" "$DIR/src.tmp"
  mkdir -p "$DIR/src.tmp"
  git -C "$REPO" archive --format=tar "$SHA" | tar -C "$DIR/src.tmp" -xf -
  echo "$SHA" > "$DIR/src.tmp/.commit"
  mv "$DIR/src.tmp" "$DIR/src"
fi
[[ "$(cat "$DIR/src/.commit")" == "$SHA" ]] || die "$DIR/src holds $(cat "$DIR/src/.commit"), not $SHA; remove $DIR"

if [[ $SOURCE_ONLY == 1 ]]; then echo "$DIR"; exit 0; fi

VERSION="$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$DIR/src/pyproject.toml" | head -1)"
[[ -n "$VERSION" ]] || die "no version in $DIR/src/pyproject.toml"

RLJOB_SOURCE_DIR="$DIR/src" RLJOB_IMAGE_TAG="$VERSION-$SHORT" RLJOB_IMAGES_DIR="$DIR/images" \
  "$HERE/build-images.sh" --only operator >/dev/null
[[ -f "$DIR/images/index.json" ]] || die "build-images.sh wrote no $DIR/images/index.json"
echo "$DIR"
