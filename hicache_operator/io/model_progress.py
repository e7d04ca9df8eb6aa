"""Reads the progress of the model downloads running in a fleet's pods (I/O).

Each pod's model-download init container serves its progress at ``model_source.PROGRESS_PATH``
on the engine's port (``model_download.py``); ``status.derive`` shows it in Progressing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from hicache_operator.api.flags import RUNTIME_PORT
from hicache_operator.plan.model.source import DOWNLOAD_CONTAINER, PROGRESS_PATH
from hicache_operator.fleet.pods import init_running

TIMEOUT = httpx.Timeout(1.0)


def _url(ip: str) -> str:
    return f"http://[{ip}]:{RUNTIME_PORT}{PROGRESS_PATH}" if ":" in ip else f"http://{ip}:{RUNTIME_PORT}{PROGRESS_PATH}"


def read(pods: list[dict]) -> dict[str, dict[str, Any]]:
    """Pod name -> its download's report, for the pods downloading now (those that answer)."""
    targets = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods
               if init_running(p, DOWNLOAD_CONTAINER) and (p.get("status") or {}).get("podIP")}
    if not targets:
        return {}

    def one(ip: str) -> dict[str, Any] | None:
        try:
            with httpx.Client(timeout=TIMEOUT) as http:
                r = http.get(_url(ip))
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        found = dict(zip(targets, pool.map(one, targets.values())))
    return {name: report for name, report in found.items() if isinstance(report, dict)}
