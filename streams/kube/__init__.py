"""The Kubernetes edge: the watch bridge and the applier, the only product code that talks to the API server."""
