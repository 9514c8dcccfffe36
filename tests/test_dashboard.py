"""optuna-dashboard (the `dashboard` extra) serves a modbench study: its trials, arms and learning curves."""

import json
import threading
import urllib.request
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest

from modbench.cli.main import main

optuna_dashboard = pytest.importorskip("optuna_dashboard")
SMOKE = (Path(__file__).resolve().parents[1] / "studies" / "smoke.toml").read_text()


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):  # no access log on the test's stderr
        pass


def test_the_dashboard_serves_the_study_with_its_arms_and_intermediate_values(tmp_cwd):
    path = tmp_cwd / "dash.toml"
    path.write_text(SMOKE.replace('name = "smoke"', 'name = "dash"').replace("seeds = [0, 1]", "seeds = [0]"))
    assert main(["study", "run", str(path), "--quiet"]) == 0
    app = optuna_dashboard.wsgi(f"sqlite:///{tmp_cwd}/runs/studies/dash/optuna.db")
    server = make_server("127.0.0.1", 0, app, handler_class=_Quiet)  # a free port
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        with urllib.request.urlopen(f"{base}/api/studies", timeout=30) as r:
            studies = json.load(r)["study_summaries"]
        (study,) = [s for s in studies if s["study_name"] == "dash"]
        with urllib.request.urlopen(f"{base}/api/studies/{study['study_id']}?after=0", timeout=30) as r:
            detail = json.load(r)
    finally:
        server.shutdown()
        thread.join(timeout=10)
    trials = detail["trials"]
    assert len(trials) == 2 and all(t["state"] == "Complete" for t in trials)
    arms = {a["value"] for t in trials for a in t["user_attrs"] if a["key"] == "arm"}
    assert arms == {"dense", "sigmoid C=0.25 alternate"}
    assert all(t["intermediate_values"] for t in trials)  # the learning curves the dashboard plots
    assert detail.get("objective_names") == ["val/bpb"]  # set_metric_names: not "Objective 0"
