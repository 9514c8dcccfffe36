"""``modbench ui`` end to end: a real study, the real MLflow server, headless Chromium.

The browser checks that a study's experiment opens in MLflow's model-training layout (not the
GenAI one), that its page lists the trials by variant and capacity, that grouping by the arm tag
shows every arm (dense included) in the table and in the charts, that the compare-runs view of two
trials shows both with their differing params, and that the metric view of two arms draws both
val/bpb curves. Each check saves a screenshot next to the study (printed with ``pytest -s``). Without
chromium/chromedriver (Debian: ``apt-get install chromium chromium-driver``) those tests skip,
except when ``CI`` is set: CI must not pass by skipping them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from modbench.cli.main import main

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "studies" / "smoke.toml"
STUDY = "ui_smoke"
WAIT_S = 120  # the MLflow SPA is slow to render on a loaded 2-core machine
SERVER_START_S = 300  # ~15 s on an idle machine; minutes when niced under a busy one

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)  # the store must be the one in the study's directory
    return env


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modbench.cli.main", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI is set, so this test may not skip")
    pytest.skip(reason)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory) -> Path:
    """A two-arm (dense, sigmoid C=0.25), one-seed study run through the CLI into its own store."""
    root = tmp_path_factory.mktemp("mlflow_ui")
    text = SMOKE.read_text().replace('name = "smoke"', f'name = "{STUDY}"').replace("seeds = [0, 1]", "seeds = [0]")
    (root / f"{STUDY}.toml").write_text(text)
    proc = _cli("study", "run", f"{STUDY}.toml", "--quiet", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def trials(study_dir) -> tuple[str, list]:
    """(experiment id, the study's trial runs) read from the store, not from the UI."""
    client = MlflowClient(tracking_uri=f"sqlite:///{study_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(STUDY)
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`mlflow.parentRunId` != ''")
    assert len(runs) == 2, [r.info.run_name for r in runs]
    return exp.experiment_id, sorted(runs, key=lambda r: r.info.run_name)


@pytest.fixture(scope="module")
def server(study_dir):
    """``modbench ui STUDY_FILE`` on a free port; yields the experiment URL it printed."""
    port = _free_port()
    log_path = study_dir / "ui.log"
    with log_path.open("w") as log:  # a file, not a pipe: an unread pipe would stall the server's logging
        proc = subprocess.Popen([sys.executable, "-m", "modbench.cli.main", "ui", f"{STUDY}.toml", "--port", str(port)],
                                cwd=study_dir, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, so teardown reaches uvicorn too
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"modbench ui exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"MLflow server did not answer within {SERVER_START_S}s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        urls = re.findall(r"http://\S+", log_path.read_text().splitlines()[0])
        assert urls and urls[0].startswith(f"http://127.0.0.1:{port}/"), log_path.read_text()[:500]
        yield urls[0]
    finally:
        proc.send_signal(signal.SIGTERM)  # modbench forwards it to the server
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if not chromium or not chromedriver:
        _unavailable(f"needs chromium and chromedriver on PATH, e.g. apt-get install chromium chromium-driver "
                     f"(found: chromium={chromium}, chromedriver={chromedriver})")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("needs selenium (pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # with the driver path below, Selenium Manager never runs
    profile = tmp_path_factory.mktemp("chromium-profile")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                "--window-size=1920,1200"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.5)


def _link(name: str):
    from selenium.webdriver.common.by import By

    return By.XPATH, f"//a[normalize-space()={json.dumps(name)}]"  # run names hold no double quotes


def _close_assistant(driver) -> None:
    """Close MLflow's chat side panel, if this version has one: it covers a third of the page."""
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.XPATH, "//*[normalize-space(text())='MLflow Assistant']"
                                                 "/ancestor::*[.//button[@aria-label='Close']][1]"
                                                 "//button[@aria-label='Close']")[:1]:
        button.click()


def _open_fresh(driver, url: str) -> None:
    """Load ``url`` as a new visitor: MLflow keeps view state (grouping, layout) in localStorage."""
    base = url.split("#", 1)[0]
    driver.get(base)
    driver.execute_script("window.localStorage.clear(); window.sessionStorage.clear();")
    driver.get("about:blank")  # a full load, not a same-document hash change
    driver.get(url)


def _shown(driver, text: str) -> list:
    """Displayed elements whose own text is ``text``."""
    from selenium.webdriver.common.by import By

    return [e for e in driver.find_elements(By.XPATH, f"//*[normalize-space(text())={json.dumps(text)}]")
            if e.is_displayed()]


def _screenshot(driver, path: Path) -> None:
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")


# --------------------------------------------------------------------------- tests


def test_run_names_carry_variant_and_capacity(trials):
    _, runs = trials
    for run in runs:
        variant, capacity = run.data.params["arm.variant"], float(run.data.params["arm.capacity"])
        assert variant in run.info.run_name
        if variant != "dense":
            assert f"C={capacity:g}" in run.info.run_name
    assert {r.data.params["arm.variant"] for r in runs} == {"dense", "sigmoid"}


def test_experiment_page_lists_the_studys_trials(browser, server, trials, study_dir):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as EC

    experiment_id, runs = trials
    assert server.endswith(f"#/experiments/{experiment_id}/runs?workflowType=machine_learning")
    browser.get(server)
    wait = _wait(browser)
    parent = wait.until(EC.visibility_of_element_located(_link(f"study {STUDY}")))
    _close_assistant(browser)
    # Trials are child runs, folded under the study's parent run until its expander is clicked.
    cell = parent.find_element(By.XPATH, "./ancestor::div[contains(@class, 'ag-cell')][1]")
    cell.find_element(By.TAG_NAME, "button").click()
    for run in runs:
        wait.until(EC.visibility_of_element_located(_link(run.info.run_name)))

    # Show the arm's variant and capacity params as columns, as a user would from "Columns".
    browser.find_element(By.CSS_SELECTOR, "[data-testid='column-selection-dropdown']").click()
    search = wait.until(EC.visibility_of_element_located((By.CSS_SELECTOR, "input[placeholder='Search columns']")))
    search.send_keys("arm.")
    for param in ("arm.variant", "arm.capacity"):
        wait.until(EC.element_to_be_clickable(
            (By.XPATH, f"//span[contains(@class, 'tree-title')][normalize-space()='{param}']"))).click()
    search.send_keys(Keys.ESCAPE)

    def cell_text(run_id: str, param: str) -> str | None:
        found = browser.find_elements(By.XPATH, f"//div[@role='row'][@row-id='{run_id}']"
                                                f"//div[@col-id='params.`{param}`']")
        return found[0].text if found else None

    for run in runs:
        for param in ("arm.variant", "arm.capacity"):
            wait.until(lambda d: cell_text(run.info.run_id, param) == run.data.params[param],
                       f"{param} of {run.info.run_name} not shown in the runs table")
    _screenshot(browser, study_dir / "experiment_page.png")


def test_compare_view_shows_both_runs_and_their_differing_params(browser, server, trials, study_dir):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    experiment_id, runs = trials
    base = server.split("#", 1)[0]
    # The SPA's own link format (mlflow/server/js: getCompareRunPageRoute): JSON arrays of ids.
    browser.get(f"{base}#/compare-runs?runs={json.dumps([r.info.run_id for r in runs])}"
                f"&experiments={json.dumps([experiment_id])}")
    wait = _wait(browser)
    wait.until(EC.visibility_of_element_located((By.XPATH, "//*[contains(text(), 'Comparing 2 Runs')]")))

    def row(name: str) -> list[str]:
        return [td.text for td in browser.find_elements(By.XPATH, f"//tr[th[normalize-space()='{name}']]/td")]

    wait.until(lambda d: len(row("arm.variant")) == 2)
    names, variants, capacities = row("Run Name:"), row("arm.variant"), row("arm.capacity")
    assert sorted(names) == [r.info.run_name for r in runs]
    by_name = {r.info.run_name: r for r in runs}
    for name, variant, capacity in zip(names, variants, capacities):  # columns are runs, in one order
        assert variant == by_name[name].data.params["arm.variant"]
        assert capacity == by_name[name].data.params["arm.capacity"]
    assert sorted(variants) == ["dense", "sigmoid"]

    # "Show diff only" keeps the params the arms differ in and hides the shared ones.
    assert row("arm.depth")
    browser.find_element(By.CSS_SELECTOR, "button[aria-label='Parameters - Show diff only']").click()
    wait.until(lambda d: not row("arm.depth"))
    assert sorted(row("arm.variant")) == ["dense", "sigmoid"] and len(row("arm.capacity")) == 2
    table = browser.find_element(By.XPATH, "//tr[th[normalize-space()='arm.variant']]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", table)
    _screenshot(browser, study_dir / "compare_runs.png")


GENAI_ONLY = ("Judges", "Prompts", "Sessions", "Evaluation runs", "Training runs")  # the GenAI sidebar and title


def test_experiment_opens_in_the_model_training_layout(browser, server, trials, study_dir):
    """The URL `modbench ui` prints opens the runs table with the model-training sidebar, for a
    visitor with no saved layout (MLflow's default is GenAI: Traces, Judges, Prompts, ...)."""
    from selenium.webdriver.support import expected_conditions as EC

    experiment_id, _ = trials
    client = MlflowClient(tracking_uri=f"sqlite:///{study_dir / 'mlflow.db'}")
    assert client.get_experiment(experiment_id).tags.get("mlflow.experimentKind") == "custom_model_development"
    _open_fresh(browser, server)
    wait = _wait(browser)
    wait.until(EC.visibility_of_element_located(_link(f"study {STUDY}")))  # the runs table has loaded
    _close_assistant(browser)
    wait.until(lambda d: _shown(d, "Model registry") and _shown(d, "Models"), "no model-training sidebar")
    assert _shown(browser, "Runs"), "the page is not titled Runs"
    assert _shown(browser, "Group by") and _shown(browser, "Columns")  # the runs table's toolbar
    for genai in GENAI_ONLY:
        assert not _shown(browser, genai), f"GenAI layout: {genai!r} is on the page"
    _screenshot(browser, study_dir / "training_layout.png")


def test_the_docs_compare_link_opens_in_the_model_training_layout(browser, server, trials, study_dir):
    """The compare link exactly as docs/studies.md gives it (…&workflowType=machine_learning), opened by a
    visitor with no saved layout: both runs side by side and nothing of MLflow 3's GenAI layout."""
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.common.by import By

    experiment_id, runs = trials
    doc = (Path(__file__).resolve().parents[1] / "docs" / "studies.md").read_text()
    template = re.search(r"`(#/compare-runs\?[^`]+)`", doc).group(1)
    link = (template.replace('["<run id>","<run id>"]', json.dumps([r.info.run_id for r in runs], separators=(",", ":")))
                    .replace('["<experiment id>"]', json.dumps([experiment_id])))
    assert "<" not in link and link.endswith("workflowType=machine_learning")
    _open_fresh(browser, server.split("#", 1)[0] + link)
    wait = _wait(browser)
    wait.until(EC.visibility_of_element_located((By.XPATH, "//*[contains(text(), 'Comparing 2 Runs')]")))
    _close_assistant(browser)
    for genai in GENAI_ONLY:
        assert not _shown(browser, genai), f"GenAI layout: {genai!r} is on the page"
    _screenshot(browser, study_dir / "compare_runs_docs_link.png")


def test_grouping_by_arm_shows_every_arm_in_table_and_charts(browser, server, trials, study_dir):
    """Group by the `modbench.arm` tag: one group per arm, dense included, in the runs table and in
    the chart view, whose val/bpb chart has a curve for each arm."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    _, runs = trials
    arms = sorted(r.data.tags["modbench.arm"] for r in runs)
    assert len(arms) == 2 and any(a.startswith("dense") for a in arms), arms
    _open_fresh(browser, server)
    wait = _wait(browser)
    wait.until(EC.visibility_of_element_located(_link(f"study {STUDY}")))
    _close_assistant(browser)
    wait.until(EC.element_to_be_clickable((By.XPATH, "//button[normalize-space()='Group by']"))).click()
    search = wait.until(EC.visibility_of_element_located((By.CSS_SELECTOR, "[role='menu'] input[placeholder='Search']")))
    search.send_keys("modbench.arm")
    wait.until(EC.element_to_be_clickable(
        (By.XPATH, "//*[@role='menu']//*[normalize-space(text())='modbench.arm']"))).click()
    wait.until(lambda d: _shown(d, "Group by: modbench.arm"), "grouping not applied")
    for arm in arms:
        wait.until(lambda d: _shown(d, f"Group: {arm}"), f"no group for arm {arm!r} in the runs table")
    for run in runs:  # groups start expanded: every trial is listed under its arm
        wait.until(EC.visibility_of_element_located(_link(run.info.run_name)))
    _screenshot(browser, study_dir / "grouped_by_arm.png")

    # The chart view (the toolbar's chart button sets compareRunsMode=CHART), same grouping.
    browser.get(browser.current_url.replace("/runs?", "/runs?compareRunsMode=CHART&", 1))
    search = wait.until(EC.visibility_of_element_located((By.CSS_SELECTOR, "input[placeholder='Search metric charts']")))
    for arm in arms:
        wait.until(lambda d: _shown(d, f"Group: {arm}"), f"arm {arm!r} missing from the chart view's run list")
    search.send_keys("val/bpb")
    card_xpath = ("//*[@data-testid='experiment-view-compare-runs-card']"
                  "[.//*[normalize-space(text())='val/bpb']]")
    card = wait.until(EC.visibility_of_element_located((By.XPATH, card_xpath)))
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", card)

    for arm in arms:  # the chart's legend names each arm's curve
        wait.until(EC.visibility_of_element_located(
            (By.XPATH, f"{card_xpath}//*[normalize-space(text())={json.dumps(f'{arm} (val/bpb)')}]")),
            f"no val/bpb curve for arm {arm!r} in the chart view")
    _screenshot(browser, study_dir / "grouped_by_arm_charts.png")


def test_metric_view_of_two_arms_draws_both_val_bpb_curves(browser, server, trials, study_dir):
    """MLflow's metric view of the two trials (its own route, as the compare page links it): a
    val/bpb curve per run, and per run the latest/min/max with their steps as the store has them."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC

    experiment_id, runs = trials
    client = MlflowClient(tracking_uri=f"sqlite:///{study_dir / 'mlflow.db'}")
    base = server.split("#", 1)[0]
    # mlflow/server/js: getMetricPageRoute(runUuids, metricKey, experimentIds, plotMetricKeys, ...)
    browser.get(f"{base}#/metric?runs={json.dumps([r.info.run_id for r in runs])}"
                f"&metric={urllib.parse.quote(json.dumps('val/bpb'))}&experiments={json.dumps([experiment_id])}"
                f"&plot_metric_keys={urllib.parse.quote(json.dumps(['val/bpb']))}&x_axis=step&{server.split('?')[-1]}")
    wait = _wait(browser)
    wait.until(EC.visibility_of_element_located((By.XPATH, "//*[contains(text(), 'Comparing 2 Runs')]")))
    _close_assistant(browser)
    for run in runs:
        wait.until(lambda d: _shown(d, f"{run.info.run_name} (val/bpb)"), f"no val/bpb curve for {run.info.run_name}")
        points = sorted(client.get_metric_history(run.info.run_id, "val/bpb"), key=lambda m: m.step)
        assert len(points) >= 2, points  # a curve, not a dot: the periodic evaluation and the final one
        low, high = min(points, key=lambda m: m.value), max(points, key=lambda m: m.value)
        expected = [f"{points[-1].value} (step={points[-1].step})", f"{low.value} (step={low.step})",
                    f"{high.value} (step={high.step})"]

        def cells(_d, name=run.info.run_name) -> list[str]:
            return [td.text for td in browser.find_elements(
                By.XPATH, f"//tr[td[1][normalize-space()={json.dumps(name)}]]/td[position() > 1]")]

        wait.until(lambda d: cells(d) == expected, f"{run.info.run_name}: table shows {cells(None)}, not {expected}")
    assert len(browser.find_elements(By.CSS_SELECTOR, "g.scatterlayer g.trace")) >= 2  # curves drawn, not only named
    _screenshot(browser, study_dir / "metric_val_bpb.png")


def test_port_in_use_is_one_line_error(study_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _cli("ui", "--port", str(port), cwd=study_dir)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"modbench: error: port {port} on 127.0.0.1 is already in use; pass --port N")


def test_missing_store_is_one_line_error(tmp_cwd, capsys):
    assert main(["ui", "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no MLflow store at" in err and "modbench study run" in err
    assert not (tmp_cwd / "mlflow.db").exists()
