"""KubeVirt's VM subresources (virt-api's start, stop, restart and evacuate/cancel) as a client must ask them.

The applier sends them (``streams.kube.applying``); the development harness asks them the
same way. virt-api serves them through the API server's aggregation layer.
"""

from __future__ import annotations

SUBRESOURCE_PATH = "/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachines/{name}/{action}"
# virt-api's EvacuateCancelHandler (pkg/virt-api/rest/evacuate_cancel.go), on the VMI.
EVACUATE_CANCEL_PATH = ("/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/{name}"
                        "/evacuate/cancel")
# As client-go asks: virt-api's start/stop/restart routes declare no Produces, and go-restful
# answers 406 to an Accept of application/json alone, even for a 202.
SUBRESOURCE_HEADERS = {"Accept": "application/json, */*", "Content-Type": "application/json"}
