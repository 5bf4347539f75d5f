"""A local Kubernetes control plane: a real etcd and kube-apiserver, envtest-style.

Tests and the demo need a real API server so that every object vmstream writes is checked
by the same machinery (and KubeVirt's own CRD schemas) a cluster applies. There is no
Docker engine, so the binaries are compiled from the Go module proxy by
``tools/k8sbins/build.sh`` into the cache, and a throwaway CA authenticates clients by
certificate (``harness.pki``). The API server serves the aggregation layer, so with
``kubevirt=True`` KubeVirt's own virt-api and virt-controller run beside it
(``harness.localkubevirt``). Nothing else runs: no controller-manager, no scheduler, no
kubelet, no virt-handler (the tests' node agent plays those three).

Two ways to use it:

* ``with LocalKube() as kube: ...`` runs a control plane for the life of the block
  (the pytest fixture does this);
* ``up()`` / ``status()`` / ``down()`` (``main(["up"])`` …) keep one running, with KubeVirt,
  in the background across commands, described by a state file under ``cache_dir()/kube/run``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import re
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from harness import processes
from harness.pki import CertificateAuthority, write_kubeconfig, write_service_account_keys
from harness.localkubevirt import KubeVirtControlPlane, KubeVirtState
from harness.locations import REPO_ROOT, cache_dir, kubevirt_crds, nodemaintenance_crd

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

K8SBINS_DIR = REPO_ROOT / "tools" / "k8sbins"
POLL_INTERVAL = 0.1
STATE_FILE = "state.json"
STOP_TIMEOUT = 20.0


class LocalKubeError(RuntimeError):
    """The local control plane could not be built, started or reached."""


def default_crds() -> list[Path]:
    """Every CRD KubeVirt installs (virt-controller watches most of them); medik8s' NodeMaintenance."""
    return [*kubevirt_crds(), nodemaintenance_crd()]


def default_run_dir() -> Path:
    """Where the background control plane (``up``) keeps its state, data and logs."""
    return cache_dir() / "kube" / "run"


# --- binaries -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Binaries:
    kube_apiserver: Path
    etcd: Path
    kubernetes_version: str
    etcd_version: str


def pinned_versions() -> tuple[str, str]:
    """(kubernetes, etcd) versions pinned by ``tools/k8sbins/go.mod``: the one source of truth."""
    text = (K8SBINS_DIR / "go.mod").read_text()

    def version(module: str) -> str:
        match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", text, re.MULTILINE)
        if match is None:
            raise LocalKubeError(f"{module} is not pinned in {K8SBINS_DIR / 'go.mod'}")
        return match.group(1)

    return version("k8s.io/kubernetes"), version("go.etcd.io/etcd/server/v3")


def ensure_binaries() -> Binaries:
    """Return the pinned binaries, compiling them first if the cache lacks them.

    The check is done here too (not only in build.sh) so that a machine with a warm cache
    needs no Go toolchain at all.
    """
    k8s_version, etcd_version = pinned_versions()
    out = cache_dir() / "k8sbins" / k8s_version
    binaries = Binaries(out / "kube-apiserver", out / "etcd", k8s_version, etcd_version)
    stamp = f"k8s.io/kubernetes {k8s_version}\ngo.etcd.io/etcd/server/v3 {etcd_version}"
    versions = out / "versions"
    if (
        binaries.kube_apiserver.is_file()
        and binaries.etcd.is_file()
        and versions.is_file()
        and versions.read_text() == stamp
    ):
        return binaries
    if shutil.which("go") is None:
        raise LocalKubeError(
            f"kube-apiserver {k8s_version} is not in {out} and there is no Go toolchain to "
            "build it (tools/k8sbins/build.sh); install Go or set KUBECONFIG to a cluster"
        )
    log.info(
        "building kube-apiserver %s and etcd %s (minutes the first time)", k8s_version, etcd_version
    )
    env = {**os.environ, "VMSTREAM_CACHE_DIR": str(cache_dir())}
    # stdout is captured (build.sh echoes its output dir) so that `up` prints only the
    # kubeconfig path; progress and compiler errors go to stderr.
    result = subprocess.run(
        ["bash", str(K8SBINS_DIR / "build.sh")],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise LocalKubeError(f"tools/k8sbins/build.sh failed with exit code {result.returncode}")
    return binaries


# --- processes ----------------------------------------------------------------------------


def _runs(binary: str) -> processes.ArgvCheck:
    """Guard against a recycled pid: the process must have been started as ``binary``."""
    return lambda argv: bool(argv) and argv[0] == binary


def _stop(pid: int, binary: str, name: str) -> None:
    processes.stop(pid, name, STOP_TIMEOUT, argv=_runs(binary))


def _wait_ready(
    what: str, check: Callable[[], bool], timeout: float, *, watch: dict[int, str], logfile: Path
) -> None:
    """``processes.wait_ready``, failing with the process's log."""
    try:
        processes.wait_ready(what, check, timeout, watch=watch)
    except processes.NotReady as failed:
        tail = processes.log_tail(logfile, 30)
        raise LocalKubeError(f"{failed}; last log lines:\n{tail}") from None


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _etcd_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(json.load(response).get("health") == "true")
    except (urllib.error.URLError, OSError, ValueError):
        return False


# --- the control plane --------------------------------------------------------------------


@dataclass
class State:
    """What a running control plane is: enough to reach it, check it and stop it."""

    workdir: str
    kubeconfig: str
    server: str
    etcd_url: str
    etcd_pid: int
    apiserver_pid: int
    etcd_binary: str
    apiserver_binary: str
    kubernetes_version: str
    etcd_version: str
    kubevirt: KubeVirtState | None = None


class LocalKube(processes.Supervisor):
    """A real etcd + kube-apiserver on free loopback ports, with vmstream's CRDs installed.

    ``workdir`` holds certificates, etcd's data, logs and the kubeconfig; by default a
    temporary directory removed on stop. ``detach=True`` starts the processes in their own
    session so they outlive this interpreter (used by ``up``). ``kubevirt=True`` runs
    KubeVirt's virt-api and virt-controller too.
    """

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        crds: Sequence[Path] | None = None,
        detach: bool = False,
        kubevirt: bool = False,
        timeout: float = 120.0,
    ) -> None:
        self._owns_workdir = workdir is None
        self.kubevirt = kubevirt
        self.workdir = Path(workdir) if workdir is not None else None
        self.crds = list(default_crds() if crds is None else crds)
        self.detach = detach
        self.timeout = timeout
        self.state: State | None = None
        self.timings: dict[str, float] = {}
        # Processes started before the state exists, so a failed start can still stop them.
        self._pending: list[tuple[int, str]] = []
        self._apiserver_argv: list[str] = []  # how the API server was started, to start it again

    # The public surface -------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return Path(self._require_state().kubeconfig)

    @property
    def server(self) -> str:
        return self._require_state().server

    def api_client(self) -> ApiClient:
        """A ``kubernetes.client.ApiClient`` authenticated as the admin (system:masters)."""
        return _api_client(self.kubeconfig)

    def client_cert(self, user: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig authenticating as ``user`` in ``groups`` (for RBAC checks).

        Without a group such as ``system:masters`` the user can do only what RBAC grants.
        """
        state = self._require_state()
        workdir = Path(state.workdir)
        if not re.fullmatch(r"[A-Za-z0-9._:@-]+", user):
            raise ValueError(f"user name not usable as a file name: {user!r}")
        stem = user.replace(":", "_")
        ca = CertificateAuthority.load(workdir / "pki")
        cert, key = ca.issue(workdir / "users", stem, user, organizations=groups)
        kubeconfig = workdir / "users" / f"{stem}.kubeconfig"
        return write_kubeconfig(
            kubeconfig, state.server, workdir / "pki" / "ca.crt", cert, key, user
        )

    def is_ready(self) -> bool:
        """Every process alive and the API server answering /readyz."""
        state = self.state
        if state is None:
            return False
        return (
            (state.kubevirt is None or KubeVirtControlPlane.running(state.kubevirt))
            and processes.running(state.etcd_pid, _runs(state.etcd_binary))
            and processes.running(state.apiserver_pid, _runs(state.apiserver_binary))
            and _http_ok(f"{state.server}/readyz", self._ssl_context())
        )

    @classmethod
    def attach(cls, workdir: Path) -> LocalKube:
        """The control plane described by ``workdir``'s state file (e.g. one started by ``up``)."""
        path = workdir / STATE_FILE
        try:
            fields = json.loads(path.read_text())
            kubevirt = fields.pop("kubevirt", None)
            state = State(**fields, kubevirt=None if kubevirt is None else KubeVirtState(**kubevirt))
        except (OSError, ValueError, TypeError) as exc:
            raise LocalKubeError(f"no usable control-plane state in {path}: {exc}") from exc
        kube = cls(workdir, detach=True, kubevirt=state.kubevirt is not None)
        kube.state = state
        return kube

    def start(self) -> LocalKube:
        if self.state is not None:
            raise LocalKubeError("already started")
        t0 = time.monotonic()
        binaries = ensure_binaries()
        self.timings["binaries"] = time.monotonic() - t0
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="vmstream-kube-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.detach:
            # A foreground control plane must not outlive its interpreter, even without stop().
            atexit.register(self.stop)
        attempts = 3
        for attempt in range(1, attempts + 1):
            try:
                self._start(binaries)
                return self
            except LocalKubeError as exc:
                # A free port can be taken by someone else between probing and binding.
                self._stop_processes()
                if "address already in use" not in str(exc) or attempt == attempts:
                    self.stop()
                    raise
                log.warning("a port was taken while starting; retrying (%d/%d)", attempt, attempts)
                shutil.rmtree(self.workdir / "etcd-data", ignore_errors=True)
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop the API server, then etcd; remove a temporary workdir."""
        self._stop_processes()
        if self._owns_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        atexit.unregister(self.stop)

    def _stop_processes(self) -> None:
        state = self.state
        if state is not None:
            if state.kubevirt is not None:
                self._stop_kubevirt(state.kubevirt)
            _stop(state.apiserver_pid, state.apiserver_binary, "kube-apiserver")
            _stop(state.etcd_pid, state.etcd_binary, "etcd")
            with contextlib.suppress(FileNotFoundError):
                (Path(state.workdir) / STATE_FILE).unlink()
            self.state = None
        for pid, name in self._pending:
            _stop(pid, name, Path(name).name)
        self._pending = []

    def _stop_kubevirt(self, kubevirt: KubeVirtState) -> None:
        """virt-api's webhooks fail closed: they go first, while the API server still runs."""
        with contextlib.suppress(Exception), self.api_client() as api:
            KubeVirtControlPlane.unregister(api)
        KubeVirtControlPlane.stop_processes(kubevirt)

    def stop_apiserver(self) -> None:
        """Stop only the API server; etcd, its data and the port stay (an API server outage)."""
        state = self._require_state()
        _stop(state.apiserver_pid, state.apiserver_binary, "kube-apiserver")

    def start_apiserver(self) -> None:
        """Start the API server again as it was first started: same port, same etcd."""
        state = self._require_state()
        api_log = Path(state.workdir) / "logs" / "kube-apiserver.log"
        state.apiserver_pid = processes.spawn(self._apiserver_argv, api_log, detach=self.detach)
        context = self._ssl_context()
        _wait_ready(
            "kube-apiserver",
            lambda: _http_ok(f"{state.server}/readyz", context),
            self.timeout,
            watch={state.apiserver_pid: "kube-apiserver", state.etcd_pid: "etcd"},
            logfile=api_log,
        )
        (Path(state.workdir) / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))

    # Internals ----------------------------------------------------------------------------

    def _require_state(self) -> State:
        if self.state is None:
            raise LocalKubeError("the control plane is not running")
        return self.state

    def _ssl_context(self) -> ssl.SSLContext:
        pki = Path(self._require_state().workdir) / "pki"
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return context

    def _start(self, binaries: Binaries) -> None:
        assert self.workdir is not None
        workdir = self.workdir.resolve()
        self._pending = []
        t0 = time.monotonic()

        pki = workdir / "pki"
        ca = CertificateAuthority.create(pki)
        serving_cert, serving_key = ca.issue(
            pki, "apiserver", "kube-apiserver", server_hosts=["127.0.0.1", "localhost"]
        )
        admin_cert, admin_key = ca.issue(pki, "admin", "admin", organizations=["system:masters"])
        # The aggregation layer: the API server proxies to extension API servers (virt-api) as
        # front-proxy-client, whose certificate only the front proxy's CA signs.
        front_proxy = CertificateAuthority.create(pki / "front-proxy", "vmstream-front-proxy-ca")
        proxy_cert, proxy_key = front_proxy.issue(pki / "front-proxy", "front-proxy-client", "front-proxy-client")
        sa_key, sa_pub = write_service_account_keys(pki)
        self.timings["certificates"] = time.monotonic() - t0

        etcd_port, peer_port, api_port = processes.free_ports(3)
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        server = f"https://127.0.0.1:{api_port}"
        logs = workdir / "logs"
        logs.mkdir(exist_ok=True)

        t1 = time.monotonic()
        etcd_log = logs / "etcd.log"
        etcd_pid = processes.spawn(
            [
                str(binaries.etcd),
                f"--data-dir={workdir / 'etcd-data'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--unsafe-no-fsync=true",
            ],
            etcd_log,
            detach=self.detach,
        )
        self._pending.append((etcd_pid, str(binaries.etcd)))
        _wait_ready(
            "etcd",
            lambda: _etcd_healthy(etcd_url),
            self.timeout,
            watch={etcd_pid: "etcd"},
            logfile=etcd_log,
        )
        self.timings["etcd"] = time.monotonic() - t1

        t2 = time.monotonic()
        api_log = logs / "kube-apiserver.log"
        cert_dir = workdir / "apiserver-certs"
        cert_dir.mkdir(exist_ok=True)
        self._apiserver_argv = [
            str(binaries.kube_apiserver),
            f"--etcd-servers={etcd_url}",
            f"--cert-dir={cert_dir}",
            f"--tls-cert-file={serving_cert}",
            f"--tls-private-key-file={serving_key}",
            f"--secure-port={api_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",
            "--authorization-mode=RBAC",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-issuer={server}/",
            f"--service-account-key-file={sa_pub}",
            f"--service-account-signing-key-file={sa_key}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            "--disable-admission-plugins=ServiceAccount",
            f"--requestheader-client-ca-file={pki / 'front-proxy' / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={proxy_cert}",
            f"--proxy-client-key-file={proxy_key}",
        ]
        apiserver_pid = processes.spawn(self._apiserver_argv, api_log, detach=self.detach)
        self._pending.append((apiserver_pid, str(binaries.kube_apiserver)))
        kubeconfig = write_kubeconfig(
            workdir / "kubeconfig", server, pki / "ca.crt", admin_cert, admin_key, "admin"
        )
        self.state = State(
            workdir=str(workdir),
            kubeconfig=str(kubeconfig),
            server=server,
            etcd_url=etcd_url,
            etcd_pid=etcd_pid,
            apiserver_pid=apiserver_pid,
            etcd_binary=str(binaries.etcd),
            apiserver_binary=str(binaries.kube_apiserver),
            kubernetes_version=binaries.kubernetes_version,
            etcd_version=binaries.etcd_version,
        )
        self._pending = []
        context = self._ssl_context()
        _wait_ready(
            "kube-apiserver",
            lambda: _http_ok(f"{server}/readyz", context),
            self.timeout,
            watch={apiserver_pid: "kube-apiserver", etcd_pid: "etcd"},
            logfile=api_log,
        )
        self.timings["apiserver"] = time.monotonic() - t2

        t3 = time.monotonic()
        install_crds(self.kubeconfig, self.crds, timeout=self.timeout)
        self.timings["crds"] = time.monotonic() - t3
        if self.kubevirt:
            t4 = time.monotonic()
            with self.api_client() as api:
                self.state.kubevirt = KubeVirtControlPlane(
                    api, server=server, ca=ca, ca_file=pki / "ca.crt", workdir=workdir,
                    detach=self.detach, timeout=self.timeout,
                ).start(self._pending)
            self._pending = []
            self.timings["kubevirt"] = time.monotonic() - t4
        self.timings["total"] = time.monotonic() - t0
        (workdir / STATE_FILE).write_text(json.dumps(asdict(self.state), indent=2))
        log.info(
            "kube-apiserver %s ready at %s in %.1fs (etcd %.1fs, apiserver %.1fs, CRDs %.1fs)",
            binaries.kubernetes_version,
            server,
            self.timings["total"],
            self.timings["etcd"],
            self.timings["apiserver"],
            self.timings["crds"],
        )


def _api_client(kubeconfig: Path) -> ApiClient:
    from kubernetes import config

    client: ApiClient = config.new_client_from_config(config_file=str(kubeconfig))
    return client


def _load_manifests(paths: Sequence[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield doc


def install_crds(kubeconfig: Path, paths: Sequence[Path], *, timeout: float = 60.0) -> list[str]:
    """Create (or keep) each CRD, then wait until the API server reports it Established.

    Responses are read raw: deserialising KubeVirt's large schemas into client models is slow
    and not needed.
    """
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    names: list[str] = []
    with _api_client(kubeconfig) as api:
        ext = client.ApiextensionsV1Api(api)
        for crd in _load_manifests(paths):
            name = crd["metadata"]["name"]
            try:
                response = ext.create_custom_resource_definition(body=crd, _preload_content=False)
                # Read the body before handing the connection back: an unread response left
                # in the pool breaks the next request on that connection.
                response.drain_conn()
                response.release_conn()
                log.debug("created CRD %s", name)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                log.debug("CRD %s already exists", name)
            names.append(name)
        deadline = time.monotonic() + timeout
        for name in names:
            while not _crd_established(ext, name):
                if time.monotonic() > deadline:
                    raise LocalKubeError(f"CRD {name} not Established after {timeout:.0f}s")
                time.sleep(POLL_INTERVAL)
    return names


def _crd_established(ext: Any, name: str) -> bool:
    response = ext.read_custom_resource_definition_status(name, _preload_content=False)
    try:
        conditions = (json.loads(response.data).get("status") or {}).get("conditions") or []
    finally:
        response.release_conn()
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


# --- a background control plane across commands ------------------------------------------


def status(run_dir: Path | None = None) -> LocalKube | None:
    """The background control plane if it is running and ready, else None."""
    run_dir = run_dir or default_run_dir()
    if not (run_dir / STATE_FILE).is_file():
        return None
    kube = LocalKube.attach(run_dir)
    return kube if kube.is_ready() else None


def up(run_dir: Path | None = None, *, timeout: float = 120.0) -> LocalKube:
    """Start the background control plane, or return the one already running (idempotent)."""
    run_dir = run_dir or default_run_dir()
    running = status(run_dir)
    if running is not None:
        return running
    down(run_dir)  # clear a stale or half-dead one
    return LocalKube(run_dir, detach=True, kubevirt=True, timeout=timeout).start()


def down(run_dir: Path | None = None) -> bool:
    """Stop the background control plane and drop its data; False if none was recorded."""
    run_dir = run_dir or default_run_dir()
    existed = (run_dir / STATE_FILE).is_file()
    if existed:
        with contextlib.suppress(LocalKubeError):
            LocalKube.attach(run_dir).stop()
    if run_dir.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
    return existed


def main(argv: list[str]) -> int:
    """``python -m harness kube up|down|status|user``: manage the background control plane."""
    parser = argparse.ArgumentParser(
        prog="python -m harness kube", description=__doc__.splitlines()[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start (or reuse) the local control plane; print the kubeconfig path")
    sub.add_parser("down", help="stop it and delete its data")
    sub.add_parser("status", help="print the kubeconfig path if running (exit 1 if not)")
    user = sub.add_parser("user", help="print a kubeconfig for another user (RBAC checks)")
    user.add_argument("name")
    user.add_argument("--group", action="append", default=[], help="repeatable")
    parser.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    try:
        if args.command == "up":
            kube = up(args.run_dir)
            print(kube.kubeconfig)
            return 0
        if args.command == "down":
            if not down(args.run_dir):
                print("no local control plane was running", file=sys.stderr)
            return 0
        kube_or_none = status(args.run_dir)
        if kube_or_none is None:
            print("local control plane is not running (python -m harness kube up)", file=sys.stderr)
            return 1
        if args.command == "status":
            state = kube_or_none._require_state()
            print(kube_or_none.kubeconfig)
            print(
                f"server {state.server} kubernetes {state.kubernetes_version} "
                f"etcd {state.etcd_version}"
                + (f" kubevirt {state.kubevirt.version} (virt-api {state.kubevirt.virt_api_url})"
                   if state.kubevirt else ""),
                file=sys.stderr,
            )
            return 0
        print(kube_or_none.client_cert(args.name, args.group))
        return 0
    except LocalKubeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    raise SystemExit(main(sys.argv[1:]))


__all__ = [
    "Binaries",
    "CertificateAuthority",
    "LocalKube",
    "LocalKubeError",
    "State",
    "default_crds",
    "down",
    "ensure_binaries",
    "install_crds",
    "main",
    "pinned_versions",
    "status",
    "up",
    "write_kubeconfig",
]
