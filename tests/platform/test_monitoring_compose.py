"""platform/compose.monitoring.yml: the local Prometheus + Grafana are wired to the project's files.

Docker cannot run here, so the compose file is checked for what would break it silently: every path
a service reads (through its bind mounts) is a file of this checkout, Grafana's datasource points at
the address Prometheus listens on, the dashboard provider reads the mounted dashboards, and images are
pinned. With Debian's `prometheus` package installed, promtool validates the scrape config it mounts.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

PLATFORM = Path(__file__).resolve().parents[2] / "platform"
COMPOSE = PLATFORM / "compose.monitoring.yml"


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def host_path(service: dict[str, Any], container_path: str) -> Path | None:
    """The checkout path a container path comes from through the service's bind mounts (relative to
    platform/, as compose resolves them), or None when no bind mount covers it."""
    target = PurePosixPath(container_path)
    for volume in service.get("volumes", []):
        source, mount, *_ = volume.split(":")
        if source.startswith("./") and target.is_relative_to(mount):
            return PLATFORM / source / target.relative_to(mount)
    return None


def _flag(command: list[str], name: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}=")]
    return value


def test_prometheus_reads_the_projects_scrape_config() -> None:
    prometheus = _services()["prometheus"]
    config = host_path(prometheus, _flag(prometheus["command"], "config.file"))
    assert config == PLATFORM / "prometheus" / "prometheus.yml"
    # The file_sd targets (relative to the config) are inside the same mount.
    (job,) = yaml.safe_load(config.read_text())["scrape_configs"]
    for pattern in (p for sd in job["file_sd_configs"] for p in sd["files"]):
        assert not PurePosixPath(pattern).is_absolute() and ".." not in pattern, pattern
    assert (PLATFORM / "prometheus" / "targets").is_dir()


def test_grafana_gets_the_datasource_and_the_dashboard() -> None:
    services = _services()
    grafana = services["grafana"]
    provisioning = host_path(grafana, "/etc/grafana/provisioning")
    assert provisioning is not None
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    listen = _flag(services["prometheus"]["command"], "web.listen-address")
    assert datasource["url"] == f"http://{listen}"
    assert services["prometheus"]["network_mode"] == grafana["network_mode"] == "host"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "disagg.yaml").read_text())["providers"]
    dashboards = host_path(grafana, provider["options"]["path"])
    assert dashboards is not None and (dashboards / "disagg-platform.json").is_file()
    home = host_path(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home is not None and home.is_file()


def test_images_are_pinned() -> None:
    for name, service in _services().items():
        tag = service["image"].partition(":")[2]
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), (name, service["image"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed: apt-get install prometheus")
def test_promtool_accepts_the_scrape_config() -> None:
    result = subprocess.run(
        ["promtool", "check", "config", str(PLATFORM / "prometheus" / "prometheus.yml")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
