"""Nodes: hosts, the workers on them, and the agents that supervise those workers."""
