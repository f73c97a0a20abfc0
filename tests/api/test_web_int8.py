"""The web page and INT8, in a real headless Chromium: the form (a checkbox per exported
file, from the products table) asks for an INT8 export and its method, the job page describes it, its report shows FP32 and INT8 accuracy (stale and
recalibrated) and the ops left in float, and offers the INT8 file for download."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from playwright.sync_api import Browser, expect

from tests.api.conftest import KEYS, wait_for
from tests.api.test_web_jobs import open_tab
from tests.api.test_web_page import JOB_TIMEOUT_MS, Tab, browser, open_form, screenshot, sign_in  # noqa: F401
from tests.conftest import save_array, save_state
from tests.nets import classifier_net, perturbed

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = "int8"


@pytest.fixture
def tab(browser: Browser) -> Iterator[Tab]:  # noqa: F811
    yield from open_tab(browser, {"width": 1280, "height": 900})


def test_the_form_asks_for_int8_and_the_job_page_shows_and_offers_it(live_server, tab, tmp_path: Path):
    torch.manual_seed(6)
    checkpoint = save_state(tmp_path / "classifier.pt", perturbed(classifier_net(4)))
    data = save_array(tmp_path / "calib.npy", torch.randn(32, 3, 8, 8))
    np.savez(tmp_path / "labelled.npz", x=torch.randn(16, 3, 8, 8).numpy(), y=np.arange(16) % 4)
    page = tab.page
    sign_in(page, f"{live_server.url}/", key=KEYS[KEY])
    open_form(page)
    page.fill("#arch", "tests.nets:classifier_net")
    page.fill("#model-kwargs", '{"classes": 4}')
    page.set_input_files("#checkpoint", str(checkpoint))
    page.set_input_files("#data", str(data))
    page.set_input_files("#eval-data", str(tmp_path / "labelled.npz"))
    page.fill("#batch-size", "8")
    page.check("#onnx_int8")
    page.select_option("#int8-method", "percentile")
    page.select_option("#int8-target", "tensorrt")
    page.check("#openvino")
    page.check("#openvino_int8")
    page.click("#submit-button")
    expect(page.locator("#submit-state")).to_contain_text("submitted", timeout=30_000)
    job_id = page.locator("#jobs-body tr").first.get_attribute("data-job-id")
    with live_server.client(KEY) as client:
        job = wait_for(client, job_id)
    assert job["status"] == "succeeded", job["error"]
    assert job["spec"]["int8"]["method"] == "percentile" and "onnx_int8" in job["spec"]["outputs"]
    assert job["spec"]["int8"]["target"] == "tensorrt"
    assert {"openvino", "openvino_int8"} <= set(job["spec"]["outputs"]) and "openvino_int8" in job["artifacts"]
    page.goto(f"{live_server.url}/jobs/{job_id}")
    expect(page.locator("#job-status")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    expect(page.locator("#job-spec")).to_contain_text("for tensorrt, percentile ranges")
    report = page.frame_locator("#report-frame")
    expect(report.locator("#int8")).to_have_text("INT8 export")
    expect(report.locator("table.int8-accuracy")).to_contain_text("INT8, recalibrated")
    expect(report.locator("table.int8-accuracy")).to_contain_text("INT8, stale statistics")
    with page.expect_download() as download:
        page.click("[data-artifact='onnx_int8']")
    assert download.value.suggested_filename == f"{job_id[:12]}-recalibrated-int8.onnx"
    with page.expect_download() as download:
        page.click("[data-artifact='openvino_int8']")
    assert download.value.suggested_filename == f"{job_id[:12]}-recalibrated-openvino-int8.tar"
    screenshot(page, "job-page-int8.png")
    page.goto(f"{live_server.url}/?edit={job_id}")  # edit and re-run: the same files asked for again
    expect(page.locator("#onnx_int8")).to_be_checked()
    for name in ("openvino", "openvino_int8"):
        expect(page.locator(f"#{name}")).to_be_checked()
    expect(page.locator("#onnx")).not_to_be_checked()
    expect(page.locator("#int8-method")).to_have_value("percentile")
    assert tab.problems == []
