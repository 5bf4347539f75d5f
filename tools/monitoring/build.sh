#!/usr/bin/env bash
# Build promtool and fetch the prometheus-operator CRDs, both from the Go module proxy.
#
# promtool checks and unit-tests deploy/components/monitoring's alerting rules; it is built
# from github.com/prometheus/prometheus at the version go.mod pins (a `tool` of this module).
# The ServiceMonitor and PrometheusRule kinds are prometheus-operator's CRDs: the YAML ships
# in that module's example/prometheus-operator-crd/, which is only downloaded, so go.sum
# alone pins it (as tools/kubevirtdata pins the medik8s module). Module and build caches
# live under the vmstream cache, and so does the output, never in the clone.
#
# Output layout (build.sh dir prints DIR):
#   DIR/promtool
#   DIR/crds/monitoring.coreos.com_{servicemonitors,prometheusrules}.yaml
#
# Usage:
#   build.sh            build (skips when the pinned versions already exist); prints the dir
#   build.sh dir        print the output dir for the pinned versions, build nothing
#   build.sh pin vP vO  regenerate go.mod/go.sum for github.com/prometheus/prometheus vP
#                       (v0.X.Y, Prometheus 3.X.Y) and prometheus-operator vO
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
name=monitoring
# shellcheck source=../gomodule.sh
source ../gomodule.sh

prometheus=github.com/prometheus/prometheus
operator=github.com/prometheus-operator/prometheus-operator
crds=(monitoring.coreos.com_servicemonitors.yaml monitoring.coreos.com_prometheusrules.yaml)

sum_version() { sed -nE "s#^$1 (v[^[:space:]/]+) h1:.*#\1#p" go.sum | head -n1; }
module_dir() { go mod download -json "$1" | sed -nE 's/^[[:space:]]*"Dir": "(.*)",?$/\1/p'; }

pin() {
    local version="$1" operator_version="$2"
    [[ "$version" =~ ^v0\.[0-9]+\.[0-9]+$ ]] || { log "not a release version: $version"; exit 2; }
    [[ "$operator_version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || { log "not a release version: $operator_version"; exit 2; }
    printf 'module vmstream/tools/monitoring\n\ngo 1.25.0\n' >go.mod
    rm -f go.sum
    GOFLAGS=-mod=mod go get -tool "$prometheus/cmd/promtool@$version"
    GOFLAGS=-mod=mod go mod tidy
    GOFLAGS=-mod=mod go mod download -json "$operator@$operator_version" |
        sed -nE 's/^[[:space:]]*"(Sum|GoModSum)": "(.*)",?$/\1 \2/p' |
        while read -r kind sum; do
            if [[ "$kind" == Sum ]]; then echo "$operator $operator_version $sum"
            else echo "$operator $operator_version/go.mod $sum"; fi
        done >>go.sum
    log "pinned $prometheus $version and $operator $operator_version; commit go.mod and go.sum"
}

prometheus_version="$(module_version "$prometheus")"
operator_version="$(sum_version "$operator")"
out="$cache/monitoring/prometheus-$prometheus_version-operator-$operator_version"
stamp="$prometheus $prometheus_version
$operator $operator_version"

build() {
    log "building promtool ($prometheus $prometheus_version) into $out (minutes the first time)"
    rm -rf "$out/crds" "$out/versions"
    go build -trimpath -ldflags "-s -w" -o "$out/promtool.tmp" "$prometheus/cmd/promtool"
    mv -f "$out/promtool.tmp" "$out/promtool"
    operator_dir="$(module_dir "$operator@$operator_version")"
    mkdir -p "$out/crds"
    for crd in "${crds[@]}"; do
        cp "$operator_dir/example/prometheus-operator-crd/$crd" "$out/crds/$crd"
    done
    chmod -R u+w "$out/crds"
}

build_once "$out" "$stamp" build "$@"
