"""The web page as a team lives in it, in a real headless Chromium against the live server:
a job submitted elsewhere appears in an open list within 2 s, a failed row says why, a
file the server has is never uploaded again (counted on the server), a spec the dry run
refuses uploads nothing, "edit and re-run" reuses the blobs, downloads are named after the
job, delete and re-run work, and at 390 px nothing scrolls sideways but the tables.

Screenshots go to ``test-artifacts/web/`` at the repository root.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from playwright.sync_api import Browser, Page, expect

from tests.api.conftest import KEYS, named_upload, submit, upload, wait_for, write_samples
from tests.api.test_web_page import (  # noqa: F401
    ARTIFACTS, JOB_TIMEOUT_MS, Tab, browser, open_form, screenshot, sign_in,
)
from tests.conftest import save_array, save_state
from tests.nets import mixed_net, perturbed

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = KEYS["weblist"]
PHONE = {"width": 390, "height": 844}


@pytest.fixture
def tab(browser: Browser) -> Iterator[Tab]:  # noqa: F811 - this module's tab signs in with its own key
    yield from open_tab(browser, {"width": 1280, "height": 900})


@pytest.fixture
def phone(browser: Browser) -> Iterator[Tab]:  # noqa: F811
    yield from open_tab(browser, PHONE)


def open_tab(browser: Browser, viewport: dict[str, int]) -> Iterator[Tab]:  # noqa: F811
    context = browser.new_context(viewport=viewport)
    page = context.new_page()
    page.set_default_timeout(20_000)
    opened = Tab(page)
    page.on("request", lambda request: opened.requested.append(f"{request.method} {request.url}"))
    page.on("pageerror", lambda error: opened.problems.append(f"page error: {error}"))
    try:
        yield opened
    finally:
        context.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, stale_checkpoint) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("web-jobs")
    checkpoint = stale_checkpoint("team-model.pt")
    data, _ = write_samples(folder / "calib-40.npy", 40)
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(24, 3, 6, 5, generator=generator) * 1.5 + 0.3).numpy()
    labelled = folder / "labelled-24.npz"
    np.savez(labelled, x=x, y=np.arange(24) % 4)
    wrong = save_array(folder / "wrong-shape.npy", torch.randn(8, 3, 1, 1))  # too small for its kernels: fails running
    return {"checkpoint": checkpoint, "data": data, "eval": labelled, "wrong": wrong}


@pytest.fixture(scope="module")
def evaluated(live_server, files) -> dict[str, Any]:
    """A succeeded job of this module's key with evaluation (top-1 before and after), and ONNX."""
    with live_server.client("weblist") as client:
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": named_upload(client, files["checkpoint"]),
                "data": named_upload(client, files["data"]), "batch_size": 8, "outputs": ["checkpoint", "onnx"],
                "eval": {"data": named_upload(client, files["eval"])}}
        job = wait_for(client, submit(client, spec)["id"])
    assert job["status"] == "succeeded", job["error"]
    return job


def uploaded_bytes(live_server) -> float:
    """What the server counted as received in blob uploads (its Prometheus counter)."""
    with live_server.client(None) as client:
        text = client.get("/metrics").text
    return float(re.search(r"^bnrecal_upload_bytes_total (\S+)$", text, re.M).group(1))


def open_list(page: Page, url: str) -> None:
    sign_in(page, f"{url}/", key=KEY)
    expect(page.locator("#feed-state")).to_have_text("live")


def fill_form(page: Page, files: dict[str, Path], batch: str = "8") -> None:
    open_form(page)
    page.fill("#arch", "tests.nets:mixed_net")
    page.fill("#model-kwargs", "{}")
    page.set_input_files("#checkpoint", str(files["checkpoint"]))
    page.set_input_files("#data", str(files["data"]))
    page.fill("#batch-size", batch)


def test_a_job_submitted_over_the_api_appears_within_2_s_and_a_failed_row_says_why(live_server, tab, files):
    page = tab.page
    with live_server.client("weblist") as client, live_server.client("alice") as other:
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": named_upload(client, files["checkpoint"]),
                "data": named_upload(client, files["wrong"]), "batch_size": 4}
        others = {"arch": "tests.nets:mixed_net", "checkpoint": upload(other, files["checkpoint"]),
                  "data": upload(other, files["data"])}
        open_list(page, live_server.url)
        others_id = submit(other, others)["id"]
        started = time.monotonic()
        job = submit(client, spec)
        row = page.locator(f"#jobs-body tr[data-job-id='{job['id']}']")
        expect(row).to_be_visible(timeout=2_000)
        appeared_s = time.monotonic() - started
        expect(row.locator(".inputs")).to_contain_text("team-model.pt")
        expect(row.locator(".inputs")).to_contain_text("wrong-shape.npy")
        expect(row.locator(".run")).to_have_text("1 worker × batch 4, sync")
        expect(row.locator(".status")).to_have_text("failed", timeout=JOB_TIMEOUT_MS)
        failed = wait_for(client, job["id"])
        expect(row.locator(".progress-text")).to_have_text(failed["error"]["title"])
        expect(row.locator(".progress-text")).to_have_class(re.compile(r"\berror\b"))
        expect(row.locator(".progress-text")).not_to_contain_text("samples")
        assert failed["error"]["title"] and page.locator(f"tr[data-job-id='{others_id}']").count() == 0
        page.select_option("#status-filter", "failed")
        expect(page.locator("#jobs-body tr")).to_have_count(1)
        expect(page.locator("#jobs-body tr").first).to_have_attribute("data-job-id", job["id"])
        page.select_option("#status-filter", "")
        screenshot(page, "jobs-live.png")
    print(f"job submitted over the API shown in the open list after {appeared_s:.2f} s")
    assert page.locator(f"tr[data-job-id='{others_id}']").count() == 0  # another key's: never
    assert tab.problems == []


def test_a_known_file_is_not_uploaded_again_and_edit_and_rerun_uploads_nothing(live_server, tab, files, evaluated):
    page = tab.page
    open_list(page, live_server.url)
    row = page.locator(f"#jobs-body tr[data-job-id='{evaluated['id']}']")
    accuracy = evaluated["report"]["evaluation"]
    before, after = accuracy["before"]["top1"], accuracy["after"]["top1"]
    expect(row.locator(".progress-text")).to_have_text(
        f"40 samples calibrated · top-1 {before:.3f} → {after:.3f}")  # the calibration count, not evaluation's 24
    received = uploaded_bytes(live_server)
    fill_form(page, files)  # the same files the evaluated job used: the server has them
    page.click("#submit-button")
    expect(page.locator("#submit-state")).to_contain_text("submitted (nothing uploaded)", timeout=30_000)
    assert uploaded_bytes(live_server) == received
    assert not [url for url in tab.requested if url.startswith("POST") and "/v1/blobs" in url]
    # Edit and re-run: the form filled in from the job; no file chosen, the same blobs used.
    page.goto(f"{live_server.url}/?edit={evaluated['id']}")
    expect(page.locator("[data-kept=checkpoint]")).to_have_text("keeps team-model.pt")
    expect(page.locator("[data-kept=eval-data]")).to_have_text("keeps labelled-24.npz")
    expect(page.locator("#onnx")).to_be_checked()
    page.fill("#batch-size", "16")
    page.click("#submit-button")
    expect(page.locator("#submit-state")).to_contain_text("submitted (nothing uploaded)", timeout=30_000)
    new_id = page.locator("#jobs-body tr").first.get_attribute("data-job-id")
    with live_server.client("weblist") as client:
        again = client.get(f"/v1/jobs/{new_id}").json()
    assert again["spec"]["batch_size"] == 16
    for name in ("checkpoint", "data"):
        assert again["spec"][name] == evaluated["spec"][name]
    assert again["spec"]["eval"]["data"] == evaluated["spec"]["eval"]["data"]
    assert uploaded_bytes(live_server) == received
    screenshot(page, "edit-and-rerun.png")
    expect(page.locator(f"#jobs-body tr[data-job-id='{new_id}'] .status")).to_have_text("succeeded",
                                                                                     timeout=JOB_TIMEOUT_MS)
    page.locator("section.panel", has=page.locator("#jobs")).screenshot(path=str(ARTIFACTS / "jobs-table.png"))
    assert tab.problems == []


def test_a_spec_the_dry_run_refuses_uploads_nothing(live_server, tab, files, tmp_path):
    fresh = save_state(tmp_path / "never-uploaded.pt", perturbed(mixed_net()))  # bytes the server has not seen
    page = tab.page
    open_list(page, live_server.url)
    received = uploaded_bytes(live_server)
    fill_form(page, {**files, "checkpoint": fresh}, batch="0")
    page.click("#submit-button")
    expect(page.locator("#form-error")).to_contain_text("422")
    expect(page.locator("#form-error")).to_contain_text("batch_size")
    page.fill("#batch-size", "8")
    page.fill("#arch", "os:system")
    page.click("#submit-button")
    expect(page.locator("#form-error")).to_contain_text("BNRECAL_MODEL_MODULES")
    assert uploaded_bytes(live_server) == received
    posts = [url for url in tab.requested if url.startswith("POST")]
    assert posts and all(url.endswith("/v1/jobs?dry_run=true") for url in posts), posts
    screenshot(page, "dry-run-refused.png")


def test_the_job_page_names_its_files_downloads_after_the_job_reruns_and_deletes(live_server, tab, evaluated):
    page = tab.page
    job_id = evaluated["id"]
    sign_in(page, f"{live_server.url}/jobs/{job_id}", key=KEY)
    expect(page.locator("#job-status")).to_have_text("succeeded")
    inputs = page.locator("#job-inputs")
    expect(inputs).to_contain_text("team-model.pt")
    expect(inputs.locator("dd[title^='sha256:']").first).to_have_attribute("title", evaluated["spec"]["checkpoint"])
    expect(page.locator("#job-spec")).to_contain_text("opset")  # ONNX was asked for here
    expect(page.locator("#job-times")).to_contain_text("finished")
    expect(page.locator("#job-phases")).to_contain_text("calibrating")
    expect(page.locator("#job-phases")).to_contain_text("evaluating")
    report = page.frame_locator("#report-frame")
    expect(report.locator("#job-context")).to_contain_text(job_id)
    expect(report.locator("#job-context")).to_contain_text("labelled-24.npz")
    expect(report.locator("#job-context")).to_contain_text("torch")
    node = evaluated["report"]["nodes"][0]
    host = evaluated["report"]["job"]["hosts"][node]
    assert host and host != node
    expect(report.locator("table", has_text="collectives").first).to_contain_text(host)  # ranks by host name
    names = {}
    for artifact in ("checkpoint", "onnx", "report", "report.html"):
        with page.expect_download() as download:
            page.click(f"[data-artifact='{artifact}']")
        names[artifact] = download.value.suggested_filename
    short = job_id[:12]
    assert names == {"checkpoint": f"{short}-recalibrated.pt", "onnx": f"{short}-recalibrated.onnx",
                     "report": f"{short}-report.json", "report.html": f"{short}-report.html"}
    with live_server.client("weblist") as client:  # the API's Content-Disposition says the same
        disposition = client.get(f"/v1/jobs/{job_id}/artifacts/checkpoint").headers["content-disposition"]
    assert f"{short}-recalibrated.pt" in disposition
    page.locator("#report-frame").scroll_into_view_if_needed()
    screenshot(page, "job-page.png")
    report.locator("#accuracy-chart svg").screenshot(path=str(ARTIFACTS / "accuracy-chart.png"))
    report.locator("#drift-chart svg").screenshot(path=str(ARTIFACTS / "drift-chart-legend.png"))
    # Re-run: the same spec, a new job, its page opened.
    page.evaluate("window.scrollTo(0, 0)")
    page.click("#rerun-button")
    expect(page.locator("#job-problem")).to_be_hidden()
    expect(page).not_to_have_url(f"{live_server.url}/jobs/{job_id}", timeout=30_000)
    rerun_id = page.url.rsplit("/", 1)[-1]
    expect(page.locator("#job-status")).to_have_text(re.compile("queued|running|succeeded"))
    with live_server.client("weblist") as client:
        rerun = wait_for(client, rerun_id)
    assert rerun["spec"] == evaluated["spec"] and rerun["status"] == "succeeded", rerun["error"]
    page.reload()
    expect(page.locator("#job-status")).to_have_text("succeeded")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#delete-button")
    expect(page).to_have_url(f"{live_server.url}/")
    expect(page.locator(f"#jobs-body tr[data-job-id='{job_id}']")).to_be_visible()
    expect(page.locator(f"#jobs-body tr[data-job-id='{rerun_id}']")).to_have_count(0)
    with live_server.client("weblist") as client:
        assert client.get(f"/v1/jobs/{rerun_id}").status_code == 404
    assert tab.problems == []


def no_sideways_scroll(page: Page) -> None:
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"the page is {width} px wide at {PHONE['width']} px"


def test_on_a_laptop_screen_the_list_comes_first_and_the_form_is_one_click_away(live_server, tab, evaluated):
    page = tab.page
    open_list(page, live_server.url)
    row = page.locator(f"#jobs-body tr[data-job-id='{evaluated['id']}']")
    expect(row).to_be_visible()
    expect(page.locator("#submit-form")).to_be_hidden()
    box = row.bounding_box()
    assert box is not None and box["y"] + box["height"] <= 900, f"the first job's row ends at {box} on a 900 px screen"
    page.screenshot(path=str(ARTIFACTS / "laptop-jobs.png"))  # the first screen, as docs/images/web-jobs.png
    page.click("#new-job > summary")
    expect(page.locator("#submit-form")).to_be_visible()
    screenshot(page, "laptop-form.png")
    assert tab.problems == []


def test_at_phone_width_only_tables_scroll_sideways(live_server, phone, evaluated):
    page = phone.page
    open_list(page, live_server.url)
    row = page.locator(f"#jobs-body tr[data-job-id='{evaluated['id']}']")
    expect(row).to_be_visible()
    no_sideways_scroll(page)
    box = page.locator(".table-scroll").first.evaluate("node => [node.scrollWidth, node.clientWidth]")
    assert box[1] <= PHONE["width"]  # a wide table would scroll inside its own box
    for cell in (row.locator(".status"), row.locator(".progress-text")):  # status and result in view, unscrolled
        seen = cell.bounding_box()
        assert seen is not None and 0 <= seen["x"] and seen["x"] + seen["width"] <= PHONE["width"], seen
    screenshot(page, "phone-jobs.png")
    page.goto(f"{live_server.url}/jobs/{evaluated['id']}")
    report = page.frame_locator("#report-frame")
    expect(report.locator("#drift-chart svg")).to_be_visible()
    no_sideways_scroll(page)
    inner = report.locator("body").evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert inner[0] <= inner[1], f"the report is {inner[0]} px wide in a {inner[1]} px frame"
    page.locator("#report-frame").scroll_into_view_if_needed()
    screenshot(page, "phone-job.png")
    page.locator("#report-frame").screenshot(path=str(ARTIFACTS / "phone-report.png"))
    assert phone.problems == []


def test_a_sweeps_page_fills_its_matrix_in_as_cells_finish(live_server, tab, files, tmp_path):
    page = tab.page
    with live_server.client("weblist") as client:
        checkpoint = named_upload(client, files["checkpoint"])
        sets = {"a": named_upload(client, files["data"]), "b": upload(client, files["eval"].read_bytes())}
        spec = {"arch": "tests.nets:mixed_net", "batch_size": 8, "rank_by": "worst_drift",
                "models": [{"checkpoint": checkpoint, "name": f"m{i}"} for i in range(3)],
                "datasets": {name: {"data": digest} for name, digest in sets.items()}}
        job_id = submit(client, spec)["id"]
        sign_in(page, f"{live_server.url}/jobs/{job_id}", key=KEY)
        first = page.locator("#sweep-matrix td.cell").first
        expect(first).to_be_visible(timeout=JOB_TIMEOUT_MS)
        expect(page.locator("#job-status")).to_have_text("running")  # drawn while the sweep goes on
        expect(page.locator("#job-spec")).to_contain_text("3 model(s) × 2 set(s)")
        expect(page.locator("#job-status")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
        expect(page.locator("#sweep-matrix td.cell-succeeded")).to_have_count(6)
        expect(page.locator("#matrix-summary")).to_contain_text("6 cell(s) done: 6 succeeded, 0 failed")
        job = client.get(f"/v1/jobs/{job_id}").json()
    drift = next(c for c in job["report"]["cells"] if c["model"] == "m2" and c["set"] == "b")["worst_drift"]
    assert float(page.locator("#sweep-matrix td[data-cell='m2/b']").inner_text()) == pytest.approx(drift, rel=6e-3)
    with page.expect_download() as download:
        page.click("[data-artifact='m1/b/report']")
    assert download.value.suggested_filename == f"{job_id[:12]}-m1-b-report.json"
    screenshot(page, "sweep-job.png")
    assert not tab.problems
