"""``dspark dashboards push``: upload the dashboards of ``dashboards/`` to a Grafana with grafana-client.

grafana-client is the maintained successor of grafana-api (no release since
2020). The dashboards go into one Grafana folder, overwriting earlier versions
with the same uid, so pushing again after an upgrade is safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspark_ray.ops.dashboards import load_all

FOLDER_UID = "dspark"


class DashboardPushError(RuntimeError):
    """Grafana refused the dashboards; the message says what to check."""


@dataclass(frozen=True)
class Pushed:
    uid: str
    title: str
    url: str  # path on the Grafana server, e.g. /d/dspark-serving/dspark-serving


def push_dashboards(url: str, token: str | None, folder: Path, folder_title: str = "dspark",
                    timeout_s: float = 10.0) -> list[Pushed]:
    """Create (or update) every dashboard JSON in ``folder`` on the Grafana at ``url``.

    Args:
        url: the Grafana base URL, e.g. ``http://127.0.0.1:3000``.
        token: a service-account token (Editor role is enough); None for a
            Grafana without auth or with ``user:password@`` in ``url``.
        folder: where the dashboard JSON files are (the repository's ``dashboards/``).
        folder_title: the Grafana folder that receives them (uid ``dspark``).

    Returns: one ``Pushed`` per dashboard. Raises ``DashboardPushError``.
    """
    try:
        from grafana_client import GrafanaApi
        from grafana_client.client import GrafanaClientError, GrafanaException
    except ImportError as exc:
        raise DashboardPushError("grafana-client is not installed: pip install 'dspark-ray[dashboards]'") from exc
    dashboards = load_all(folder)
    if not dashboards:
        raise DashboardPushError(f"no dashboard JSON in {folder}; run `dspark dashboards build` first")
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    try:
        try:
            api.folder.get_folder(FOLDER_UID)
        except GrafanaClientError as exc:
            if exc.status_code != 404:
                raise
            api.folder.create_folder(folder_title, uid=FOLDER_UID)
        pushed = []
        for dash in dashboards:
            reply = api.dashboard.update_dashboard({
                "dashboard": {**dash, "id": None}, "folderUid": FOLDER_UID, "overwrite": True,
                "message": "dspark dashboards push",
            })
            pushed.append(Pushed(dash["uid"], dash["title"], reply.get("url", "")))
        return pushed
    except GrafanaException as exc:
        hint = ""
        if exc.status_code in (401, 403):
            hint = " (check --token: a service-account token with the Editor role)"
        raise DashboardPushError(f"Grafana at {url} answered {exc.status_code}: {exc.message}{hint}") from exc
    except OSError as exc:
        raise DashboardPushError(f"cannot reach Grafana at {url}: {exc}") from exc
