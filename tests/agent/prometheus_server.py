"""A real Prometheus for the tests, scraping one sidecar every second with the given rules."""

import json
import shutil
import subprocess
from pathlib import Path

from pd_transfer.processes.ports import spare_port


def start_prometheus(tmp_path: Path, rules: Path, target: str) -> tuple[subprocess.Popen, str]:
    """Prometheus on a spare loopback port, logging to ``tmp_path/prometheus.log``: the
    process (the caller stops it) and its base URL."""
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {"job_name": "pd-transfer-static", "static_configs": [{"targets": [target]}]}
                ],
            }
        )
    )
    port = spare_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            shutil.which("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}"
