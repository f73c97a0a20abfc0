"""max_samples "auto", the order and the standard errors over HTTP and on the web page: the
job spec takes them (a bad combination is a 422 naming the field), the form submits them,
and the job page and its report say where the statistics converged."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.api.conftest import KEYS, submit, upload, wait_for, write_samples
from tests.api.test_web_page import JOB_TIMEOUT_MS, browser, open_form, screenshot, sign_in, tab  # noqa: F401

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def sampling_files(tmp_path_factory: pytest.TempPathFactory, stale_checkpoint) -> dict[str, Path]:
    data, _ = write_samples(tmp_path_factory.mktemp("web-sampling") / "calib-800.npy", 800)
    return {"checkpoint": stale_checkpoint("stale.pt"), "data": data}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"max_samples": "auto", "mode": "local"}, "max_samples"),
        ({"max_samples": "all"}, "max_samples"),
        ({"tolerance": 0.05}, "tolerance"),
        ({"order": "sorted"}, "order"),
        ({"seed": -1}, "seed"),
    ],
)
def test_a_bad_sampling_spec_is_a_422_naming_the_field(live_server, sampling_files, change, field):
    with live_server.client("errors") as client:  # not the page's key: its list shows the form's job only
        spec = {
            "arch": "tests.nets:mixed_net", "checkpoint": upload(client, sampling_files["checkpoint"]),
            "data": upload(client, sampling_files["data"]), **change,
        }
        response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    assert field in response.json()["detail"]


def test_auto_through_the_api_reports_convergence(live_server, sampling_files):
    with live_server.client("errors") as client:  # not the page's key: its list shows the form's job only
        spec = {
            "arch": "tests.nets:mixed_net", "checkpoint": upload(client, sampling_files["checkpoint"]),
            "data": upload(client, sampling_files["data"]), "batch_size": 8, "workers": 2,
            "max_samples": "auto", "tolerance": 0.1, "seed": 4,
        }
        job = wait_for(client, submit(client, spec)["id"])
    assert job["status"] == "succeeded", job["error"]
    report = job["report"]
    assert report["convergence"]["converged"] and report["samples"] < 800
    assert (report["order"], report["seed"]) == ("shuffled", 4)
    assert job["spec"]["max_samples"] == "auto"


def test_the_form_submits_auto_and_the_job_page_says_where_it_converged(live_server, tab, sampling_files):  # noqa: F811
    page = tab.page
    # A key of its own: the list holds this job alone, so its first row is this job's (with the
    # shared web key, an earlier test's finished job may still be first when the status is read).
    sign_in(page, f"{live_server.url}/", key=KEYS["sampling"])
    open_form(page)
    page.fill("#arch", "tests.nets:mixed_net")
    page.set_input_files("#checkpoint", str(sampling_files["checkpoint"]))
    page.set_input_files("#data", str(sampling_files["data"]))
    page.fill("#batch-size", "8")
    page.fill("#max-samples", "auto")
    page.fill("#tolerance", "0.1")
    page.click("#submit-button")
    expect(page.locator("#submit-state")).to_contain_text("submitted", timeout=JOB_TIMEOUT_MS)
    expect(page.locator("#jobs-body tr")).to_have_count(1, timeout=JOB_TIMEOUT_MS)
    row = page.locator("#jobs-body tr").first
    expect(row.locator(".status")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    row.locator("a").click()
    line = page.locator("#job-statistics")
    expect(line).to_be_visible()
    expect(line).to_contain_text("statistics converged at")
    expect(line).to_contain_text("of 800 samples: every standard error under ±10.0%, about how far more data of the "
                                 "same kind would move them (worst: ")
    expect(page.locator("#job-spec")).to_contain_text("until the statistics converge (±10.0%)")
    expect(page.locator("#job-spec")).to_contain_text("shuffled (seed 0)")
    report = page.frame_locator("#report-frame")
    expect(report.locator("#precision-summary")).to_contain_text("Statistics converged at")
    expect(report.locator("#precision-chart svg")).to_be_visible()
    screenshot(page, "job-converged.png")
    assert tab.problems == []
