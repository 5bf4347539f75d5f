"""What the tests share: readers of the real parts, KubeVirt's schema, and the stand-ins for KubeVirt's controllers."""
