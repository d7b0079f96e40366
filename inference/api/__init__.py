"""REST API of the control plane (DRF): nodes, models, deployments, workers, rules, scale events."""
