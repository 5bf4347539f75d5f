"""What the tests share: the real parts as pytest plugins, readers of them, KubeVirt's schema, and
the node agent — the one stand-in on KubeVirt's side, for the scheduler, the kubelet and virt-handler."""
