# Sourced by tools/*/build.sh: what building from the Go module proxy has in common.
#
# The caller sets `name` (its log prefix), then sources this file from its own directory.
# It gets what buildonce.sh gives (`cache`, `log`, `build_once`), Go's module and build
# caches under the vmstream cache (never in the clone), a read-only module graph, and
# `module_version MODULE` (the version go.mod pins).

# shellcheck source=buildonce.sh
source "$(dirname "${BASH_SOURCE[0]}")/buildonce.sh"

export GOMODCACHE="$cache/go/mod"
export GOCACHE="$cache/go/build"
export CGO_ENABLED=0
export GOFLAGS="-mod=readonly -buildvcs=false"

# Versions come from go.mod alone, so a script never drifts from what is committed.
module_version() { sed -nE "s#^[[:space:]]*(require[[:space:]]+)?$1[[:space:]]+(v[^[:space:]]+).*#\2#p" go.mod | head -n1; }
