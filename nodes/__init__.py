"""Nodes: the hosts of the platform (Node), their resource detection, registration and heartbeats.

The lower layer of the control plane: it never imports `inference`. The workers placed on a node and the
agent that runs them belong to the `inference` app (inference.models.workers, inference.agent).
"""
