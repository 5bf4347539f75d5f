# vmstream: one image for every job of the `vmstream` command (the worker by default).
#
#   docker build --build-arg PYTHON_DIGEST=sha256:... -t vmstream .   # the base's digest: below
#   docker run --rm --read-only --tmpfs /tmp -v vmstream-data:/var/lib/vmstream \
#     -v "$PWD/examples/config.yaml:/etc/vmstream/config.yaml:ro" \
#     -e VMSTREAM_KAFKA__BOOTSTRAP_SERVERS=kafka:9092 -e VMSTREAM_WORKER__WEB_HOST=0.0.0.0 \
#     -p 6066:6066 vmstream
#
# Read-only root filesystem: the process writes only under /tmp and /var/lib/vmstream
# (Faust's data directory, declared a VOLUME). With `readOnlyRootFilesystem: true` in
# Kubernetes, mount an emptyDir at both paths.
#
# The worker's web server (/health, /ready, /metrics) listens on 127.0.0.1 unless
# VMSTREAM_WORKER__WEB_HOST (or worker.web_host in the config file) says otherwise: set it to
# 0.0.0.0 for probes and port publishing to reach it. It is not set here because the
# environment takes precedence over the config file.

# The base image is pinned by digest: every build starts from the same bytes, and a new
# base is a reviewed change, not whatever the tag points at that day. The digest is that of
# python:3.11-slim's multi-platform index (the same for amd64 and arm64), the "Digest:" line of
#
#   docker buildx imagetools inspect python:3.11-slim
#
# None is committed yet (none could be checked against the registry when this was written):
# give it to each build, `docker build --build-arg PYTHON_DIGEST=sha256:<64 hex> -t vmstream .`
# (compose: VMSTREAM_PYTHON_DIGEST), or commit it as this ARG's default. A build without it
# stops at the first FROM: "PYTHON_DIGEST: is not allowed to be unset" (or "… empty").
ARG PYTHON_DIGEST

# ---------------------------------------------------------------------------- build
FROM python:3.11-slim@${PYTHON_DIGEST:?} AS build

# Set by BuildKit. On amd64 every dependency ships a binary wheel; elsewhere some
# (faust-streaming's C extensions) may be built from source and need a compiler.
ARG TARGETARCH
# hadolint ignore=DL3008
RUN if [ "${TARGETARCH:-amd64}" != "amd64" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/vmstream
ENV PATH=/opt/vmstream/bin:$PATH

WORKDIR /src
# The dependencies first, from the lock alone, so a source change reuses this layer:
# requirements.lock (`make lock`) pins every package of pyproject.toml's runtime
# dependencies, and the build backend, with the hashes of their files. pip refuses a file
# whose hash differs and any dependency the lock lacks.
COPY requirements.lock ./
RUN pip install --require-hashes -r requirements.lock
# Then the package itself (no test extras), with nothing more installed (--no-deps) and
# built by the locked setuptools (--no-build-isolation: no unpinned download). README.md is
# optional: the glob may match nothing (pyproject.toml is named too, so that even the
# legacy builder has a source).
COPY pyproject.toml LICENSE README.m[d] ./
COPY handlers ./handlers
COPY streams ./streams
# pip and setuptools are not needed at run time (nothing imports them): leave them out of
# the image, with fewer files to scan and patch.
RUN pip install --no-deps --no-build-isolation . \
    && pip check \
    && python -m pip uninstall -y pip setuptools

# -------------------------------------------------------------------------- runtime
FROM python:3.11-slim@${PYTHON_DIGEST:?} AS runtime

LABEL org.opencontainers.image.title="vmstream" \
      org.opencontainers.image.description="Keeps GPU-passthrough VMs on KubeVirt right, event by event, over Kafka." \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed, numeric non-root user, so `runAsNonRoot` can check it and volumes can be
# prepared for it (fsGroup 10001).
RUN groupadd --system --gid 10001 vmstream \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/vmstream \
        --no-create-home --shell /usr/sbin/nologin vmstream \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/vmstream \
    && install -d -m 0755 /etc/vmstream

COPY --from=build /opt/vmstream /opt/vmstream
# A default configuration so the image runs as it is; mount your own over it.
COPY examples/config.yaml /etc/vmstream/config.yaml

# HOME and the data directory are the volume; caches and scratch files go to /tmp. The
# bytecode was compiled at install time: nothing tries to write it at run time.
# APP_DATADIR is Faust's data directory ({conf.name} is the app id): absolute, so the
# tables do not depend on the working directory.
ENV PATH=/opt/vmstream/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/var/lib/vmstream \
    XDG_CACHE_HOME=/tmp/.cache \
    TMPDIR=/tmp \
    APP_DATADIR=/var/lib/vmstream/{conf.name}-data

WORKDIR /var/lib/vmstream
VOLUME ["/var/lib/vmstream"]
USER 10001:10001

EXPOSE 6066
# One check for whichever process the container runs (`vmstream health`,
# streams/cli/health.py): it finds the vmstream process, reads where that process serves
# /health as the process does (its arguments, its configuration file, the environment:
# worker 6066, apply 6067, watch 6068, api 6069, notify 6070) and asks it; a one-shot
# command (`topics create`) has nothing to check. `python -m streams.cli.health` is the
# same check without importing the other subcommands: 0.1 s of CPU each time, not 1 s.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "streams.cli.health"]

ENTRYPOINT ["vmstream"]
CMD ["worker", "--config", "/etc/vmstream/config.yaml"]
