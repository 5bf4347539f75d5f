#!/usr/bin/env bash
# Generate Strimzi's CRDs from Maven Central, the way Strimzi's own build does.
#
# Strimzi does not publish its CRDs on a package registry: its build generates them from the
# API's classes (io.strimzi:api) with its CrdGenerator (io.strimzi:crd-generator). This runs
# the same generator over the same classes, at the version pom.xml pins, with the arguments of
# the api module's `generate-crd-co-install-v1` execution (its pom.xml, inside the api jar at
# META-INF/maven/io.strimzi/api/pom.xml): apiextensions.k8s.io/v1 CRDs serving and storing
# kafka.strimzi.io/v1 alone, as packaging/install/cluster-operator ships them. Maven fetches
# the two jars into the vmstream cache's Maven repository (beside Kafka's), sha256sums checks
# them, and the output lives in the cache too, never in the clone.
#
# The generator's classes are Java 21 class files: it runs on the first Java 21 or newer of
# $JAVA_HOME, PATH and /usr/lib/jvm; Maven itself runs on any Java it supports.
#
# Output layout (build.sh dir prints DIR):
#   DIR/crds/<plural>.<group>.yaml   one CRD a file, named after it (kafkatopics.kafka.strimzi.io)
#
# Usage:
#   build.sh            build (skips when the pinned CRDs already exist); prints the dir
#   build.sh dir        print the output dir for the pinned version, build nothing
#   build.sh pin X.Y.Z  point pom.xml at another Strimzi release and regenerate sha256sums
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
name=strimzicrds
# shellcheck source=../buildonce.sh
source ../buildonce.sh

DEPENDENCY_PLUGIN=org.apache.maven.plugins:maven-dependency-plugin:3.8.1
repository="$cache/maven/repository"

# The CRDs Strimzi's build generates for the cluster operator's install files: the model
# class, then the file's name here (the CRD's own name).
CRDS=(
    io.strimzi.api.kafka.model.kafka.Kafka=kafkas.kafka.strimzi.io
    io.strimzi.api.kafka.model.connect.KafkaConnect=kafkaconnects.kafka.strimzi.io
    io.strimzi.api.kafka.model.topic.KafkaTopic=kafkatopics.kafka.strimzi.io
    io.strimzi.api.kafka.model.user.KafkaUser=kafkausers.kafka.strimzi.io
    io.strimzi.api.kafka.model.bridge.KafkaBridge=kafkabridges.kafka.strimzi.io
    io.strimzi.api.kafka.model.connector.KafkaConnector=kafkaconnectors.kafka.strimzi.io
    io.strimzi.api.kafka.model.mirrormaker2.KafkaMirrorMaker2=kafkamirrormaker2s.kafka.strimzi.io
    io.strimzi.api.kafka.model.rebalance.KafkaRebalance=kafkarebalances.kafka.strimzi.io
    io.strimzi.api.kafka.model.podset.StrimziPodSet=strimzipodsets.core.strimzi.io
    io.strimzi.api.kafka.model.nodepool.KafkaNodePool=kafkanodepools.kafka.strimzi.io
)

# The version comes from pom.xml alone, so the script never drifts from what is committed.
pom_version() { sed -nE 's#^[[:space:]]*<strimzi\.version>([^<]+)</strimzi\.version>.*#\1#p' pom.xml | head -n1; }

# fetch DIR: the two jars pom.xml names, and nothing else (its exclusions), into DIR.
fetch() {
    mvn -q -B -C -Dstyle.color=never -Dmaven.repo.local="$repository" -f pom.xml \
        "$DEPENDENCY_PLUGIN:copy-dependencies" -DoutputDirectory="$1" >&2
}

# The first Java 21 or newer: the generator's class files need it.
java21() {
    local candidate spec
    for candidate in ${JAVA_HOME:+"$JAVA_HOME/bin/java"} "$(command -v java || true)" /usr/lib/jvm/*/bin/java; do
        [[ -n "$candidate" && -x "$candidate" ]] || continue
        spec="$("$candidate" -XshowSettings:properties -version 2>&1 |
            sed -nE 's/^[[:space:]]*java\.specification\.version = ([0-9]+)$/\1/p')"
        if [[ "${spec:-0}" -ge 21 ]]; then echo "$candidate"; return 0; fi
    done
    return 1
}

pin() {
    local version="$1"
    [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { log "not a release version: $version"; exit 2; }
    sed -i -E "s#(<strimzi\.version>)[^<]+(</strimzi\.version>)#\1$version\2#" pom.xml
    pin_tmp="$(mktemp -d)"
    trap 'rm -rf "$pin_tmp"' EXIT
    fetch "$pin_tmp"
    (cd "$pin_tmp" && sha256sum -- *.jar) >sha256sums
    log "pinned io.strimzi:api and io.strimzi:crd-generator $version; compare CRDS and the"
    log "generator's arguments here with the generate-crd-co-install-v1 execution of"
    log "META-INF/maven/io.strimzi/api/pom.xml in the api jar, then commit pom.xml and sha256sums"
}

version="$(pom_version)"
[[ -n "$version" ]] || { log "pom.xml pins no strimzi.version"; exit 2; }
out="$cache/strimzicrds/$version"
stamp="io.strimzi:api $version
io.strimzi:crd-generator $version"

build() {
    local java work entry crd
    java="$(java21)" || {
        log "Strimzi's CrdGenerator needs Java 21 or newer: none in JAVA_HOME, on PATH or in /usr/lib/jvm"
        exit 1
    }
    log "generating Strimzi $version's CRDs into $out with $java"
    rm -rf "$out/crds" "$out/versions"
    work="$out/work"
    rm -rf "$work"
    mkdir -p "$work/jars" "$work/crds"
    fetch "$work/jars"
    (cd "$work/jars" && sha256sum --quiet --strict -c "$here/sha256sums") >&2 || {
        log "the jars Maven fetched do not match tools/strimzicrds/sha256sums"
        exit 1
    }
    local args=()
    for entry in "${CRDS[@]}"; do args+=("${entry%%=*}=$work/crds/${entry#*=}.yaml"); done
    "$java" -classpath "$work/jars/api-$version.jar:$work/jars/crd-generator-$version.jar" \
        io.strimzi.crdgenerator.CrdGenerator \
        --label app:strimzi --label strimzi.io/crd-install:true \
        --target-kube 1.16+ --crd-api-version v1 --api-versions v1 --storage-version v1 \
        --yaml "${args[@]}" >&2
    for entry in "${CRDS[@]}"; do
        crd="${entry#*=}"
        grep -qxF "  name: $crd" "$work/crds/$crd.yaml" || { log "$crd.yaml does not hold the CRD $crd"; exit 1; }
    done
    mv "$work/crds" "$out/crds"
    rm -rf "$work"
}

build_once "$out" "$stamp" build "$@"
