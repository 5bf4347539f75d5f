#!/usr/bin/env bash
# Build kube-apiserver and etcd from the Go module proxy, envtest-style.
#
# Neither binary is published on a package registry, and there is no Docker engine to pull
# them from an image, so they are compiled from this small module (go.mod pins
# k8s.io/kubernetes and replaces its staging modules; etcd comes from the same module graph).
# Module and build caches live under the vmstream cache, never in the clone.
#
# Usage:
#   build.sh            build (skips when the pinned binaries already exist); prints the dir
#   build.sh dir        print the output dir for the pinned versions, build nothing
#   build.sh pin vX.Y.Z regenerate go.mod/go.sum for another k8s.io/kubernetes release
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
name=k8sbins
# shellcheck source=../gomodule.sh
source ../gomodule.sh

pin() {
    local version="$1" staging gomod
    [[ "$version" =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] || { log "not a release version: $version"; exit 2; }
    staging="v0.${BASH_REMATCH[1]}.${BASH_REMATCH[2]}"
    # The kubernetes module requires its staging modules at v0.0.0 (which does not exist) and
    # replaces them with ./staging dirs; mirror each of those replaces with the published tag.
    gomod="$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$version" |
        sed -nE 's/^[[:space:]]*"GoMod": "(.*)",?$/\1/p')"
    {
        printf 'module vmstream/tools/k8sbins\n\ngo 1.25.0\n\ngodebug default=go1.25\n\n'
        printf 'tool (\n\tgo.etcd.io/etcd/server/v3\n\tk8s.io/kubernetes/cmd/kube-apiserver\n)\n\n'
        printf 'require k8s.io/kubernetes %s\n\nreplace (\n' "$version"
        sed -nE "s#^[[:space:]]+(k8s\.io/[^[:space:]]+) => \./staging/.*#\t\1 => \1 $staging#p" "$gomod"
        printf ')\n'
    } >go.mod
    rm -f go.sum
    GOFLAGS=-mod=mod go mod tidy
    log "pinned k8s.io/kubernetes $version (staging $staging); commit go.mod and go.sum"
}

k8s_version="$(module_version k8s.io/kubernetes)"
etcd_version="$(module_version go.etcd.io/etcd/server/v3)"
out="$cache/k8sbins/$k8s_version"
stamp="k8s.io/kubernetes $k8s_version
go.etcd.io/etcd/server/v3 $etcd_version"

build() {
    minor="${k8s_version#v1.}"
    minor="${minor%%.*}"
    build_date="$(go list -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)"
    v=k8s.io/component-base/version
    kube_ldflags="-s -w -X $v.gitVersion=$k8s_version -X $v.gitMajor=1 -X $v.gitMinor=$minor"
    kube_ldflags+=" -X $v.gitTreeState=clean -X $v.buildDate=$build_date"

    log "building kube-apiserver $k8s_version into $out (first time takes many minutes)"
    go build -trimpath -tags selinux,notest -ldflags "$kube_ldflags" \
        -o "$out/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
    log "kube-apiserver built; building etcd $etcd_version"
    go build -trimpath -ldflags "-s -w" -o "$out/etcd.tmp" go.etcd.io/etcd/server/v3
    mv -f "$out/kube-apiserver.tmp" "$out/kube-apiserver"
    mv -f "$out/etcd.tmp" "$out/etcd"
}

build_once "$out" "$stamp" build "$@"
