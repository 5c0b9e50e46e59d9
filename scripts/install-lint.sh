#!/usr/bin/env bash
# install-lint.sh — install the pinned tools `make lint` runs: staticcheck (Go module proxy, pinned
# version) and shellcheck (Debian's package, via apt-get when it is missing).
#
# Usage: scripts/install-lint.sh
# Environment: GOBIN (default `go env GOPATH`/bin) receives staticcheck. Prints the staticcheck
# path as its last line.
set -euo pipefail

STATICCHECK_VERSION=v0.8.2   # honnef.co/go/tools; change here only (the Makefile asks this script)

export PATH=/usr/local/go/bin:$PATH
die() { echo "install-lint: error: $*" >&2; exit 1; }
log() { echo "install-lint: $*" >&2; }

command -v go >/dev/null || die "Go not found (install Go >= 1.26 at /usr/local/go)"
gobin=${GOBIN:-$(go env GOPATH)/bin}
sc=$gobin/staticcheck

# `go version -m` names the module version a binary was built from: reinstall on any mismatch.
have=$( { go version -m "$sc" 2>/dev/null || true; } | awk '$1 == "mod" && $2 == "honnef.co/go/tools" {print $3}')
if [ "$have" != "$STATICCHECK_VERSION" ]; then
  log "installing staticcheck $STATICCHECK_VERSION into $gobin${have:+ (found $have)}"
  GOBIN=$gobin go install "honnef.co/go/tools/cmd/staticcheck@$STATICCHECK_VERSION"
fi

if ! command -v shellcheck >/dev/null; then
  log "installing shellcheck (apt-get)"
  [ "$(id -u)" -eq 0 ] || die "shellcheck missing and not root: apt-get install shellcheck"
  DEBIAN_FRONTEND=noninteractive apt-get -qq update
  DEBIAN_FRONTEND=noninteractive apt-get -qq install -y shellcheck >/dev/null
fi
command -v shellcheck >/dev/null || die "shellcheck still not on PATH after apt-get"

echo "$sc"
