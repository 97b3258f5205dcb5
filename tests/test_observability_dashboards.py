"""The Grafana dashboards: valid dashboard JSON, generated from dspark_ray.ops.dashboards, provisioning
files that load them, and `dspark dashboards push` through grafana-client against a stand-in Grafana.

Whether each query's metrics exist in a real scrape is tested in test_observability_prometheus.py.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from dspark_ray.cli import main
from dspark_ray.ops import dashboards
from dspark_ray.ops.grafana_push import DashboardPushError, push_dashboards

FOLDER = REPO / "dashboards"
FILES = sorted(FOLDER.glob("*.json"))


def test_the_json_files_are_generated_from_the_definitions():
    assert [p.name for p in FILES] == sorted(dashboards.file_name(d) for d in dashboards.DASHBOARDS)
    for dash in dashboards.DASHBOARDS:
        assert (FOLDER / dashboards.file_name(dash)).read_text() == dashboards.render(dash), \
            "dashboards/ is stale: run `dspark dashboards build`"


def test_four_dashboards_with_unique_uids():
    loaded = dashboards.load_all(FOLDER)
    uids = [d["uid"] for d in loaded]
    assert sorted(uids) == ["dspark-cluster", "dspark-serving", "dspark-slots", "dspark-speculation"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_each_file_is_a_valid_dashboard(path: Path):
    dash = json.loads(path.read_text())
    assert dash["title"] and dash["uid"] and len(dash["uid"]) <= 40
    assert isinstance(dash["schemaVersion"], int) and dash["time"]["from"] and dash["panels"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip()
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= set(variables), f"{panel['title']}: undefined variables {used - set(variables)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_query_reads_ray_exported_metrics(path: Path):
    for expr in dashboards.queries(json.loads(path.read_text())):
        names = dashboards.metric_names(expr)
        assert names and all(n.startswith("ray_") for n in names), (expr, names)
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_metric_names_of_promql():
    expr = ('histogram_quantile(0.99, sum by (le, rank) (rate(a_bucket{model=~"$model", x="sum(b)"}[5m]))) '
            "/ ignoring(position) group_left sum by (model) (rate(c_total[1m])) + 1e-3 * d offset 5m")
    assert dashboards.metric_names(expr) == {"a_bucket", "c_total", "d"}
    assert dashboards.metric_names("label_values(ray_dspark_slot_capacity, app)") == {"ray_dspark_slot_capacity"}


def test_provisioning_loads_the_folder(tmp_path):
    source = yaml.safe_load((FOLDER / "provisioning" / "datasources" / "dspark.yaml").read_text())
    (ds,) = source["datasources"]
    assert source["apiVersion"] == 1 and ds["type"] == "prometheus"
    assert ds["uid"] == dashboards.PROVISIONED_DATASOURCE_UID
    default = json.loads(FILES[0].read_text())["templating"]["list"][0]["current"]["value"]
    assert default == ds["uid"]
    provider = yaml.safe_load((FOLDER / "provisioning" / "dashboards" / "dspark.yaml").read_text())
    (p,) = provider["providers"]
    assert provider["apiVersion"] == 1 and p["type"] == "file"
    assert p["options"]["path"] == "${DSPARK_DASHBOARDS_DIR}"  # the runbook sets it to this folder
    assert len(dashboards.load_all(FOLDER)) == 4


# -- push ------------------------------------------------------------------------------------------------


class FakeGrafana(ThreadingHTTPServer):
    """Answers the three calls `push` makes, like Grafana's HTTP API, and records them."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.calls: list[tuple[str, str, dict | None, str | None]] = []
        self.folders: set[str] = set()
        super().__init__(("127.0.0.1", 0), _GrafanaHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _GrafanaHandler(BaseHTTPRequestHandler):
    server: FakeGrafana

    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.calls.append((method, self.path, body, self.headers.get("Authorization")))
        if self.headers.get("Authorization") != f"Bearer {self.server.token}":
            return self._reply(401, {"message": "invalid API key"})
        if method == "GET" and self.path.startswith("/api/folders/"):
            uid = self.path.rsplit("/", 1)[1]
            if uid in self.server.folders:
                return self._reply(200, {"uid": uid, "title": "dspark"})
            return self._reply(404, {"message": "folder not found"})
        if method == "POST" and self.path == "/api/folders":
            self.server.folders.add(body["uid"])
            return self._reply(200, {"uid": body["uid"], "title": body["title"]})
        if method == "POST" and self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            return self._reply(200, {"status": "success", "uid": uid, "url": f"/d/{uid}/x", "version": 1})
        return self._reply(404, {"message": "not found"})

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")


@pytest.fixture
def grafana():
    server = FakeGrafana(token="s3cret")
    yield server
    server.shutdown()
    server.server_close()


def test_push_creates_the_folder_and_every_dashboard(grafana):
    pushed = push_dashboards(grafana.url, "s3cret", FOLDER)
    assert sorted(p.uid for p in pushed) == sorted(d.uid for d in dashboards.DASHBOARDS)
    methods = [(m, path) for m, path, _, _ in grafana.calls]
    assert methods[:2] == [("GET", "/api/folders/dspark"), ("POST", "/api/folders")]
    posts = [body for m, path, body, _ in grafana.calls if path == "/api/dashboards/db"]
    assert len(posts) == 4
    for body in posts:
        assert body["overwrite"] is True and body["folderUid"] == "dspark" and body["dashboard"]["id"] is None
        assert body["dashboard"]["panels"]
    assert all(auth == "Bearer s3cret" for *_, auth in grafana.calls)
    # Pushing again reuses the folder and overwrites the dashboards.
    grafana.calls.clear()
    push_dashboards(grafana.url, "s3cret", FOLDER)
    assert ("POST", "/api/folders") not in [(m, p) for m, p, _, _ in grafana.calls]


def test_push_command(grafana, capsys):
    assert main(["dashboards", "push", "--url", grafana.url, "--token", "s3cret"]) == 0
    out = capsys.readouterr().out
    assert f"{grafana.url}/d/dspark-serving/x" in out and out.count("\n") == 4


def test_push_with_a_wrong_token_says_so(grafana, capsys):
    with pytest.raises(DashboardPushError, match="401.*check --token"):
        push_dashboards(grafana.url, "wrong", FOLDER)
    assert main(["dashboards", "push", "--url", grafana.url, "--token", "wrong"]) == 1
    assert "check --token" in capsys.readouterr().err


def test_push_to_nothing_says_so(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(DashboardPushError, match="cannot reach Grafana"):
        push_dashboards(f"http://127.0.0.1:{port}", "t", FOLDER, timeout_s=2)
    with pytest.raises(DashboardPushError, match="no dashboard JSON"):
        push_dashboards(f"http://127.0.0.1:{port}", "t", tmp_path)


def test_build_command_writes_the_files(tmp_path, capsys):
    assert main(["dashboards", "build", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [p.name for p in FILES]
