"""Tests of the deployment files under platform/ (Prometheus, Grafana)."""
