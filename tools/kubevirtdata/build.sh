#!/usr/bin/env bash
# Generate the third-party data vmstream tests against, and build KubeVirt's own
# virt-controller and virt-api, from the Go module proxy.
#
# KubeVirt's CRDs and the objects its control plane needs (RBAC, virt-api's webhook
# configurations and APIServices) are produced by KubeVirt's own code: main.go calls
# virt-operator's generators at the kubevirt.io/kubevirt version pinned in go.mod, which also
# names cmd/virt-controller and cmd/virt-api as tools so their whole module graph is pinned.
# KubeVirt's example manifests are copied from that same module, and the NodeMaintenance CRD
# from the medik8s node-maintenance-operator module (its checksum is pinned in go.sum: the
# checksum database does not know the module). Module and build caches live under the
# vmstream cache, and so does the output, never in the clone. -trimpath keeps build-cache
# entries reusable from any checkout.
#
# Output layout (build.sh dir prints DIR):
#   DIR/kubevirt/crds/<plural>.kubevirt.io.yaml
#   DIR/kubevirt/control-plane/{rbac,webhooks,apiservices}.yaml   (namespace "kubevirt")
#   DIR/kubevirt/examples/*.yaml
#   DIR/kubevirt/bin/{virt-controller,virt-api}                    (static, CGO_ENABLED=0)
#   DIR/medik8s/nodemaintenances.nodemaintenance.medik8s.io.yaml
#
# Usage:
#   build.sh            build (skips when the pinned data already exists); prints the dir
#   build.sh dir        print the output dir for the pinned versions, build nothing
#   build.sh pin vX.Y.Z [vA.B.C]
#                       regenerate go.mod/go.sum for another kubevirt.io/kubevirt release (and
#                       node-maintenance-operator release; default: the one go.sum pins now)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
name=kubevirtdata
# shellcheck source=../gomodule.sh
source ../gomodule.sh

nmo=github.com/medik8s/node-maintenance-operator
nmo_crd=config/crd/bases/nodemaintenance.medik8s.io_nodemaintenances.yaml
# The proxy serves the module; the checksum database lacks it, so go.sum is the only check.
export GONOSUMDB="$nmo"

# The medik8s module is only downloaded, never imported, so go.sum alone pins it.
sum_version() { sed -nE "s#^$1 (v[^[:space:]/]+) h1:.*#\1#p" go.sum | head -n1; }

# The module's directory in the module cache, downloading (and checking against go.sum) first.
module_dir() { go mod download -json "$1" | sed -nE 's/^[[:space:]]*"Dir": "(.*)",?$/\1/p'; }

pin() {
    local version="$1" nmo_version="${2:-$(sum_version "$nmo")}" gomod
    [[ "$version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || { log "not a release version: $version"; exit 2; }
    [[ "$nmo_version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || { log "not a release version: $nmo_version"; exit 2; }
    # KubeVirt's go.mod replaces its staging modules (kubevirt.io/api, kubevirt.io/client-go)
    # with ./staging dirs and pins k8s.io/* and a few others; mirror every replace, the staging
    # ones with the tags published alongside the release.
    gomod="$(GOFLAGS=-mod=mod go mod download -json "kubevirt.io/kubevirt@$version" |
        sed -nE 's/^[[:space:]]*"GoMod": "(.*)",?$/\1/p')"
    {
        printf 'module vmstream/tools/kubevirtdata\n\ngo 1.24.0\n\n'
        printf 'tool (\n\tkubevirt.io/kubevirt/cmd/virt-api\n\tkubevirt.io/kubevirt/cmd/virt-controller\n)\n\n'
        printf 'require kubevirt.io/kubevirt %s\n\nreplace (\n' "$version"
        sed -n '/^replace (/,/^)/p' "$gomod" | sed -nE \
            -e "s#^[[:space:]]+([^[:space:]]+) => \./staging/.*#\t\1 => \1 $version#p" \
            -e 's#^[[:space:]]+([^[:space:]]+ => [^.[:space:]][^[:space:]]* v[^[:space:]]+)$#\t\1#p'
        printf ')\n'
    } >go.mod
    rm -f go.sum
    GOFLAGS=-mod=mod go mod tidy
    # Pin the medik8s module too; only build.sh reads it, so go mod tidy must not see it.
    GOFLAGS=-mod=mod go mod download -json "$nmo@$nmo_version" |
        sed -nE 's/^[[:space:]]*"(Sum|GoModSum)": "(.*)",?$/\1 \2/p' |
        while read -r kind sum; do
            if [[ "$kind" == Sum ]]; then echo "$nmo $nmo_version $sum"; else echo "$nmo $nmo_version/go.mod $sum"; fi
        done >>go.sum
    log "pinned kubevirt.io/kubevirt $version and $nmo $nmo_version; commit go.mod and go.sum"
}

kubevirt_version="$(module_version kubevirt.io/kubevirt)"
nmo_version="$(sum_version "$nmo")"
# "control-plane": this layout (with the binaries); an older checkout keeps its own directory.
out="$cache/kubevirtdata/kubevirt-$kubevirt_version-nmo-$nmo_version-control-plane"
# The last line names what the build makes besides data; a cache without it is rebuilt.
stamp="kubevirt.io/kubevirt $kubevirt_version
$nmo $nmo_version
binaries virt-controller virt-api"

build() {
    log "generating KubeVirt $kubevirt_version's CRDs and building virt-controller and virt-api into $out (the first build takes minutes)"
    rm -rf "$out/kubevirt" "$out/medik8s" "$out/versions"
    go build -trimpath -ldflags "-s -w" -o "$out/kubevirtdata" .
    "$out/kubevirtdata" "$out/kubevirt"
    rm -f "$out/kubevirtdata"
    for command in virt-controller virt-api; do
        go build -trimpath -ldflags "-s -w" -o "$out/kubevirt/bin/$command" "kubevirt.io/kubevirt/cmd/$command"
    done

    kubevirt_dir="$(module_dir "kubevirt.io/kubevirt@$kubevirt_version")"
    mkdir -p "$out/kubevirt/examples"
    cp "$kubevirt_dir"/examples/*.yaml "$out/kubevirt/examples/"

    # go.sum holds this module's checksum; go mod download verifies the zip against it.
    nmo_dir="$(module_dir "$nmo@$nmo_version")"
    mkdir -p "$out/medik8s"
    cp "$nmo_dir/$nmo_crd" "$out/medik8s/nodemaintenances.nodemaintenance.medik8s.io.yaml"

    chmod -R u+w "$out/kubevirt" "$out/medik8s"
}

build_once "$out" "$stamp" build "$@"
