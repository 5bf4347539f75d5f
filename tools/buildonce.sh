# Sourced by tools/*/build.sh (directly, or through gomodule.sh): what every build of a
# third-party part has in common, whatever registry it comes from.
#
# The caller sets `name` (its log prefix). It gets: `cache` (the vmstream cache), `log`, and
# `build_once OUT STAMP BUILD_FUNCTION "$@"`, which handles `dir` / `pin` / `build`, skips
# the build when OUT/versions holds STAMP, and takes a lock so two test sessions starting at
# once neither build twice nor race on the outputs. `pin ARGS…` is the caller's function.

cache="${VMSTREAM_CACHE_DIR:-$HOME/.cache/vmstream}"

log() { echo "$name: $*" >&2; }

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
