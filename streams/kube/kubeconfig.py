"""Where the watch bridge and the applier find their Kubernetes API: one precedence for both.

1. ``--kubeconfig FILE``, when given;
2. else ``$KUBECONFIG`` (the first file of a ``:``-separated list), when set;
3. else the Pod's ServiceAccount (in-cluster), when ``$KUBERNETES_SERVICE_HOST`` is set;
4. else ``~/.kube/config``.

This is kubectl's order, with in-cluster where kubectl has its own default: an operator
who sets ``KUBECONFIG`` (or the flag) means it, and a ``~/.kube/config`` left in an image
never wins over the Pod's own credentials. (The kubernetes client's ``load_config`` tries
``~/.kube/config`` before in-cluster; the applier followed in-cluster before
``$KUBECONFIG``; the bridge this order.)

Each problem is one :class:`~streams.common.errors.KubernetesUnavailable`: the file named is
missing or not a kubeconfig, none of the four is there, or the API server it names does not
answer within a few seconds (:func:`reach_kubernetes`).
"""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes import client, config

from streams.common.errors import KubernetesUnavailable

KUBE_PROBE_SECONDS = 5.0
HINT = "give a kubeconfig with --kubeconfig or $KUBECONFIG (or run in a Pod with a ServiceAccount)"


def _source(kubeconfig: str | None) -> tuple[str, str | None]:
    """Which of the four applies: (``"flag"``, path) | (``"KUBECONFIG"``, path) |
    (``"in-cluster"``, None) | (``"default"``, path)."""
    if kubeconfig:
        return "flag", kubeconfig
    listed = os.environ.get("KUBECONFIG", "")
    if listed:
        return "KUBECONFIG", listed.split(os.pathsep)[0]
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "in-cluster", None
    return "default", str(Path("~/.kube/config").expanduser())


def kube_configuration(kubeconfig: str | None) -> client.Configuration:
    """The client configuration of the first source that applies (module docstring)."""
    source, path = _source(kubeconfig)
    configuration = client.Configuration()
    if path is None:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException as error:
            raise KubernetesUnavailable(f"in-cluster configuration unusable: {error}", HINT) from error
        return configuration
    named = {"flag": "--kubeconfig", "KUBECONFIG": "$KUBECONFIG", "default": "the default kubeconfig"}[source]
    if not Path(path).is_file():
        raise KubernetesUnavailable(f"kubeconfig {path} ({named}) does not exist", HINT)
    try:
        config.load_kube_config(config_file=path, client_configuration=configuration)
    except Exception as error:  # ConfigException, yaml's errors, a TypeError on a malformed file
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise KubernetesUnavailable(f"kubeconfig {path} ({named}) is not usable: {first}", HINT) from error
    return configuration


def api_client(kubeconfig: str | None, *, pool_size: int | None = None) -> client.ApiClient:
    """A client of :func:`kube_configuration`; ``pool_size`` connections kept open, one per
    call in flight."""
    configuration = kube_configuration(kubeconfig)
    if pool_size is not None:
        configuration.connection_pool_maxsize = max(pool_size, configuration.connection_pool_maxsize or 0)
    return client.ApiClient(configuration)


def reach_kubernetes(configuration: client.Configuration, timeout: float = KUBE_PROBE_SECONDS) -> None:
    """Raise :class:`KubernetesUnavailable` unless the API server answers ``/version`` (any
    HTTP status: it is there) within ``timeout`` seconds."""
    from kubernetes.client.exceptions import ApiException

    from streams.common.startup import quiet

    with client.ApiClient(configuration) as api, quiet("urllib3"):
        try:
            client.VersionApi(api).get_code(_request_timeout=timeout)
        except ApiException:
            return  # it answered (even 401/403: credentials are the calls' business)
        except Exception as error:  # urllib3's MaxRetryError, a timeout, a TLS failure
            reason = getattr(error, "reason", None) or error
            raise KubernetesUnavailable(
                f"the Kubernetes API at {configuration.host} does not answer within {timeout:g}s: "
                f"{type(reason).__name__}",
                "start it, or point --kubeconfig / $KUBECONFIG at one that runs") from error
