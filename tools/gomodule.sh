# Sourced by tools/*/build.sh: what building from the Go module proxy has in common.
#
# The caller sets `name` (its log prefix), then sources this file from its own directory.
# It gets: Go's module and build caches under the vmstream cache (never in the clone), a
# read-only module graph, `log`, `module_version MODULE` (the version go.mod pins), and
# `build_once OUT STAMP BUILD_FUNCTION "$@"`, which handles `dir` / `pin` / `build`, skips
# the build when OUT/versions holds STAMP, and takes a lock so two test sessions starting at
# once neither build twice nor race on the outputs.

cache="${VMSTREAM_CACHE_DIR:-$HOME/.cache/vmstream}"
export GOMODCACHE="$cache/go/mod"
export GOCACHE="$cache/go/build"
export CGO_ENABLED=0
export GOFLAGS="-mod=readonly -buildvcs=false"

log() { echo "$name: $*" >&2; }

# Versions come from go.mod alone, so a script never drifts from what is committed.
module_version() { sed -nE "s#^[[:space:]]*(require[[:space:]]+)?$1[[:space:]]+(v[^[:space:]]+).*#\2#p" go.mod | head -n1; }

_is_built() { [[ -f "$1/versions" && "$(cat "$1/versions")" == "$2" ]]; }

# build_once OUT STAMP BUILD [dir|pin ARGS…|build]: BUILD writes OUT's files (not versions).
build_once() {
    local out="$1" stamp="$2" build="$3"
    shift 3
    case "${1:-build}" in
        dir) echo "$out"; return 0 ;;
        pin) shift; pin "$@"; return 0 ;;
        build) ;;
        *) log "unknown command: $1"; exit 2 ;;
    esac
    if _is_built "$out" "$stamp"; then echo "$out"; return 0; fi
    mkdir -p "$out"
    exec 9>"$out/.lock"
    if command -v flock >/dev/null; then flock 9; fi
    if _is_built "$out" "$stamp"; then echo "$out"; return 0; fi
    local start=$SECONDS
    "$build"
    printf '%s' "$stamp" >"$out/versions"
    log "done in $((SECONDS - start))s"
    echo "$out"
}
