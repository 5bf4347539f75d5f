"""What the tests share: the real parts as pytest plugins, readers of them, and KubeVirt's schema.
The one stand-in on KubeVirt's side, the node agent, is the harness's (harness/node_agent.py)."""
