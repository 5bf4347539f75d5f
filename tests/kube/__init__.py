"""Tests of what talks to the Kubernetes API server (the watch bridge), on a real one."""
