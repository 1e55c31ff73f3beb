"""The real one-node Kubernetes cluster kit and its suite (docs/real-cluster.md)."""
