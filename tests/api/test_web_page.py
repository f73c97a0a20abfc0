"""The web page in a real headless Chromium (Debian's, driven by Playwright) against the live
server: submit through the form and follow the live stream to ``succeeded``, the report's
charts, downloads, cancel, the key kept in sessionStorage only, problem details shown,
and no request leaving the server's origin. Plus plain HTTP checks of what is served.

Screenshots go to ``test-artifacts/web/`` at the repository root.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urljoin

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from playwright.sync_api import Browser, Page, Playwright, expect, sync_playwright

from bnrecal.service.settings import Settings

from bnrecal.api.app import create_app
from bnrecal.service.export.products import PRODUCTS
from tests.api.conftest import KEYS, submit, upload, wait_for, write_samples
from tests.conftest import save_array, save_state
from tests.nets import MARKER, marker_net, mixed_net, perturbed

pytestmark = pytest.mark.usefixtures("ray_cluster")

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"
KEY = KEYS["web"]
JOB_TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium for the module; a missing browser fails with the way to install it."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: run `make test` (it installs it) or `apt-get install -y chromium`",
            pytrace=False,
        )
    playwright: Playwright = sync_playwright().start()
    try:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=LAUNCH_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        playwright.stop()


@dataclass
class Tab:
    """A page in a fresh browser context, with every URL it requested and every problem it logged."""

    page: Page
    requested: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def foreign_requests(self, origin: str) -> list[str]:
        """Requests that went anywhere but the server (``blob:`` and ``data:`` stay in the browser)."""
        return [url for url in self.requested if not url.startswith((origin + "/", "blob:", "data:"))]


@pytest.fixture
def tab(browser: Browser) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(20_000)
    opened = Tab(page)
    page.on("request", lambda request: opened.requested.append(request.url))
    page.on("pageerror", lambda error: opened.problems.append(f"page error: {error}"))
    page.on(
        "console",
        lambda message: opened.problems.append(f"console: {message.text}")
        if "Content Security Policy" in message.text or "Refused" in message.text
        else None,
    )
    try:
        yield opened
    finally:
        context.close()


def sign_in(page: Page, url: str, key: str = KEY, accepted: bool = True) -> None:
    """Open ``url``, give the page the key it asks for, and (if ``accepted``) wait for the app."""
    page.goto(url)
    expect(page.locator("#key-panel")).to_be_visible()
    page.fill("#key-input", key)
    page.click("#key-form button[type=submit]")
    if accepted:
        # The key is checked against the server before the page starts; until then the form
        # has no listeners (a file chosen earlier would not switch the model kind).
        expect(page.locator("#app")).to_be_visible()


def open_form(page: Page) -> None:
    """Unfold the "New job" form, as a user clicks its heading (it is folded above the list
    unless the key had no jobs when the list first loaded)."""
    expect(page.locator("#jobs-body[data-loaded]")).to_have_count(1)
    if not page.locator("#new-job").evaluate("node => node.open"):
        page.click("#new-job > summary")
    expect(page.locator("#submit-form")).to_be_visible()


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory, stale_checkpoint) -> dict[str, Path]:
    data, _ = write_samples(tmp_path_factory.mktemp("web") / "calib.npy", 48)
    return {"checkpoint": stale_checkpoint("stale.pt"), "data": data}


RECORD_ROW_CHANGES = """() => {
  window.__pageMarker = "not reloaded";
  window.__rows = [];
  const body = document.getElementById("jobs-body");
  new MutationObserver(() => {
    const row = body.querySelector("tr");
    if (!row) return;
    window.__rows.push([row.dataset.jobId, row.querySelector(".status").textContent,
                        row.querySelector(".progress-text").textContent]);
  }).observe(body, {subtree: true, childList: true, characterData: true});
}"""


def test_a_job_submitted_through_the_form_goes_live_to_succeeded_and_shows_its_report(live_server, tab, model_files):
    page = tab.page
    sign_in(page, f"{live_server.url}/")
    open_form(page)
    page.fill("#arch", "tests.nets:mixed_net")
    page.fill("#model-kwargs", '{"channels": 6}')
    page.set_input_files("#checkpoint", str(model_files["checkpoint"]))
    page.set_input_files("#data", str(model_files["data"]))
    page.fill("#workers", "1")
    page.fill("#batch-size", "4")
    page.select_option("#mode", "sync")
    page.evaluate(RECORD_ROW_CHANGES)
    submitted_at = len(tab.requested)
    page.click("#submit-button")

    row = page.locator("#jobs-body tr").first
    expect(row.locator(".status")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    expect(row.locator(".progress-text")).to_have_text("48 samples calibrated")
    job_id = row.get_attribute("data-job-id")
    # What the row showed came from the key's change stream: the page was not reloaded and
    # never asked for the job list or the job again after submitting.
    assert page.evaluate("window.__pageMarker") == "not reloaded"
    after_submit = [url.removeprefix(live_server.url) for url in tab.requested[submitted_at:]]
    asked = [url for url in after_submit if url.startswith("/v1/blobs/sha256:")]
    blobs = ["/v1/blobs?filename=stale.pt", "/v1/blobs?filename=calib.npy"]
    assert after_submit == [*asked, "/v1/jobs?dry_run=true", *blobs, "/v1/jobs"], after_submit
    assert len(asked) == 2  # HEAD: does the server have them? (it does not: both uploaded)
    seen = [(status, text) for seen_id, status, text in page.evaluate("window.__rows") if seen_id == job_id]
    assert seen[0][0] in ("queued", "running") and seen[-1] == ("succeeded", "48 samples calibrated"), seen
    screenshot(page, "jobs.png")

    with live_server.client("web") as client:
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["spec"]["batch_size"] == 4 and job["spec"]["model_kwargs"] == {"channels": 6}

    row.locator("a").click()
    expect(page).to_have_url(f"{live_server.url}/jobs/{job_id}")
    expect(page.locator("#job-status")).to_have_text("succeeded")
    expect(page.locator("#cancel-button")).to_be_hidden()
    expect(page.locator("#job-spec")).to_contain_text("tests.nets:mixed_net")
    expect(page.locator("#job-inputs")).to_contain_text("stale.pt")
    expect(page.locator("#job-spec")).not_to_contain_text("opset")  # no ONNX asked for: no ONNX options
    report = page.frame_locator("#report-frame")
    chart = report.locator("#drift-chart svg")
    expect(chart).to_be_visible()
    box = chart.bounding_box()
    assert box is not None and box["width"] > 200 and box["height"] > 100
    bars = report.locator("#drift-chart svg g[id^=patch] path")
    assert bars.count() >= 2 * len(job["report"]["layers"])
    assert any((b := bars.nth(i).bounding_box()) and b["height"] > 0 for i in range(bars.count()))
    # The report's inline styles apply in its frame (blue mean-shift bars, not black default fill).
    fills = {bars.nth(i).evaluate("node => getComputedStyle(node).fill") for i in range(bars.count())}
    assert "rgb(59, 110, 168)" in fills, fills
    chart_source = chart.evaluate("node => node.innerHTML")
    for layer in job["report"]["layers"]:
        assert layer["name"] in chart_source
        expect(report.locator("#drift-table")).to_contain_text(layer["name"])
    read_storage = "() => { try { return sessionStorage.length; } catch (e) { return 'denied'; } }"
    frame_sees = report.locator("body").evaluate(read_storage)
    assert frame_sees == "denied"  # the sandboxed report cannot read the page's storage
    assert page.locator("#report-frame").bounding_box()["height"] > 900  # sized to the report

    with page.expect_download() as download_info:
        page.click("[data-artifact=checkpoint]")
    download = download_info.value
    assert download.suggested_filename == f"{job_id[:12]}-recalibrated.pt"
    digest = "sha256:" + hashlib.sha256(Path(download.path()).read_bytes()).hexdigest()
    assert digest == job["artifacts"]["checkpoint"]["digest"]
    screenshot(page, "job-report.png")
    # Chromium does not animate an offscreen cross-origin frame: bring it into view first.
    page.locator("#report-frame").scroll_into_view_if_needed()
    chart.screenshot(path=str(ARTIFACTS / "drift-chart.png"))

    assert tab.foreign_requests(live_server.url) == []
    assert tab.problems == []


def test_a_program_submitted_through_the_form_comes_back_recalibrated(live_server, tab, model_files, tmp_path):
    """The form with a torch.export program instead of an architecture and checkpoint."""
    from tests.programs import export_program

    torch.manual_seed(0)
    program = export_program(perturbed(mixed_net()), torch.randn(1, 3, 6, 5), tmp_path / "team.pt2")
    page = tab.page
    sign_in(page, f"{live_server.url}/")
    open_form(page)
    page.set_input_files("#program", str(program))
    page.set_input_files("#data", str(model_files["data"]))
    page.fill("#batch-size", "8")
    page.click("#onnx")
    page.click("#submit-button")
    expect(page.locator("#submit-state")).to_contain_text("submitted", timeout=JOB_TIMEOUT_MS)
    row = page.locator("#jobs-body tr").first  # the new job's row, now that it is prepended
    expect(row.locator(".status")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    expect(row.locator("td.model")).to_have_text("program team.pt2")
    job_id = row.get_attribute("data-job-id")
    with live_server.client("web") as client:
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert "arch" not in job["spec"] or job["spec"]["arch"] is None
    assert job["spec"]["outputs"] == ["program", "onnx"] and set(job["artifacts"]) >= {"program", "onnx"}
    row.locator("a").click()
    with page.expect_download() as download_info:
        page.click("[data-artifact=program]")
    download = download_info.value
    digest = "sha256:" + hashlib.sha256(Path(download.path()).read_bytes()).hexdigest()
    assert digest == job["artifacts"]["program"]["digest"]
    assert torch.export.load(download.path()).state_dict["bn.num_batches_tracked"].item() > 0
    assert tab.problems == []


def test_parquet_data_with_its_image_column_named_in_the_form(live_server, tab, tmp_path):
    """A Parquet file with two columns of image bytes needs its image column named: the form's
    field reaches the job's spec and the job calibrates on that column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.nets import classifier_net
    from tests.shards import photos

    items = photos(6, size=40)
    thumbs = photos(6, size=24, seed=1)
    pq.write_table(pa.table({"img": [data for _, data, _ in items], "thumb": [data for _, data, _ in thumbs]}),
                   tmp_path / "photos.parquet")
    torch.manual_seed(0)
    checkpoint = save_state(tmp_path / "classifier.pt", perturbed(classifier_net(3)))
    page = tab.page
    sign_in(page, f"{live_server.url}/")
    open_form(page)
    page.fill("#arch", "tests.nets:classifier_net")
    page.fill("#model-kwargs", '{"classes": 3}')
    page.set_input_files("#checkpoint", str(checkpoint))
    page.set_input_files("#data", str(tmp_path / "photos.parquet"))
    page.fill("#batch-size", "3")
    page.fill("#image-column", "img")
    page.click("#submit-button")
    expect(page.locator("#submit-state")).to_contain_text("submitted", timeout=JOB_TIMEOUT_MS)
    row = page.locator("#jobs-body tr").first
    expect(row.locator(".status")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    with live_server.client("web") as client:
        job = client.get(f"/v1/jobs/{row.get_attribute('data-job-id')}").json()
    assert job["spec"]["image_column"] == "img" and job["spec"].get("label_column") is None
    assert job["report"]["samples"] == 6 and job["report"]["dataset"]["sample_shape"] == [3, 224, 224]
    assert tab.problems == []


def test_the_key_lives_in_session_storage_only(live_server, tab):
    page = tab.page
    sign_in(page, f"{live_server.url}/")
    expect(page.locator("#jobs")).to_be_visible()
    expect(page.locator("#key-state")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('bnrecal.apiKey')") == KEY
    assert page.evaluate("document.cookie") == "" and page.context.cookies() == []
    assert page.evaluate("localStorage.length") == 0
    page.reload()  # the tab's session keeps it: no second prompt
    expect(page.locator("#jobs")).to_be_visible()
    expect(page.locator("#key-panel")).to_be_hidden()
    assert tab.requested and all(KEY not in url for url in tab.requested)
    page.click("#forget-key")
    expect(page.locator("#key-panel")).to_be_visible()
    expect(page.locator("#app")).to_be_hidden()
    assert page.evaluate("sessionStorage.length") == 0
    assert tab.problems == []


def test_a_key_with_no_jobs_is_told_how_to_run_one(live_server, tab):
    """An empty list says what to do: the form (opened), what it needs, and the demo's files to try."""
    page = tab.page
    sign_in(page, f"{live_server.url}/", key=KEYS["empty"])
    expect(page.locator("#jobs-empty")).to_be_visible()
    hint = page.locator("#jobs-empty").inner_text()
    assert "No jobs yet for this API key" in hint and "give the form above" in hint and "make demo" in hint
    assert page.evaluate("document.getElementById('new-job').open")
    assert tab.problems == []


def test_a_wrong_key_shows_the_401_detail_and_is_not_kept(live_server, tab):
    page = tab.page
    sign_in(page, f"{live_server.url}/", key="not-a-key", accepted=False)
    expect(page.locator("#key-error")).to_have_text("401 Unauthorized: invalid API key")
    expect(page.locator("#app")).to_be_hidden()
    assert page.evaluate("sessionStorage.length") == 0
    screenshot(page, "wrong-key.png")


def test_an_invalid_spec_shows_the_422_detail_naming_the_field(live_server, tab, model_files):
    page = tab.page
    sign_in(page, f"{live_server.url}/")
    open_form(page)
    page.fill("#arch", "tests.nets:mixed_net")
    page.set_input_files("#checkpoint", str(model_files["checkpoint"]))
    page.set_input_files("#data", str(model_files["data"]))
    page.fill("#batch-size", "0")
    page.click("#submit-button")
    expect(page.locator("#form-error")).to_contain_text("422")
    expect(page.locator("#form-error")).to_contain_text("batch_size: Input should be greater than or equal to 1")
    page.fill("#batch-size", "4")
    page.fill("#arch", "os:system")
    page.click("#submit-button")
    expect(page.locator("#form-error")).to_contain_text("BNRECAL_MODEL_MODULES")
    page.fill("#arch", "tests.nets:mixed_net")
    page.fill("#model-kwargs", "{not json")
    page.click("#submit-button")
    expect(page.locator("#form-error")).to_contain_text("model_kwargs: not valid JSON")
    screenshot(page, "invalid-spec.png")
    assert tab.problems == []


def test_a_job_of_no_one_or_another_key_shows_the_404_detail(live_server, tab, model_files):
    with live_server.client("alice") as client:  # another tenant's job is a 404 for this key
        spec = {"arch": "tests.nets:mixed_net", "checkpoint": upload(client, model_files["checkpoint"]),
                "data": upload(client, model_files["data"])}
        others = submit(client, spec)["id"]
    page = tab.page
    sign_in(page, f"{live_server.url}/jobs/{others}")
    expect(page.locator("#job-problem")).to_contain_text("404 Not found: no job")
    expect(page.locator("#job-status")).to_have_text("not found")
    page.goto(f"{live_server.url}/jobs/%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E")
    expect(page.locator("#job-problem")).to_contain_text("404 Not found: no job '<img src=x onerror=alert(1)>'")
    expect(page.locator("#job-id")).to_have_text("<img src=x onerror=alert(1)>")  # shown as text, not markup
    assert page.locator("img").count() == 0
    assert tab.problems == []


def test_cancel_from_the_job_page_ends_the_job_cancelled(live_server, tab, tmp_path):
    samples = torch.randn(40, 4)
    samples[9, 0] = MARKER  # the third step of 4 hangs: the job stays running, with progress made
    with live_server.client("web") as client:
        spec = {
            "arch": "tests.nets:marker_net",
            "model_kwargs": {"action": "hang"},
            "checkpoint": upload(client, save_state(tmp_path / "m.pt", marker_net())),
            "data": upload(client, save_array(tmp_path / "m.npy", samples)),
            "batch_size": 4, "order": "given",
        }
        job = submit(client, spec)
    page = tab.page
    sign_in(page, f"{live_server.url}/jobs/{job['id']}")
    expect(page.locator("#job-status")).to_have_text("running", timeout=JOB_TIMEOUT_MS)
    expect(page.locator("#job-progress-text")).to_have_text(re.compile(r"^[1-9]\d* / 40 samples"), timeout=60_000)
    expect(page.locator("#cancel-button")).to_be_visible()
    page.once("dialog", lambda dialog: dialog.dismiss())  # asked to confirm: "no" leaves it running
    page.click("#cancel-button")
    expect(page.locator("#job-status")).to_have_text("running")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#cancel-button")
    expect(page.locator("#job-status")).to_have_text("cancelled", timeout=60_000)
    expect(page.locator("#cancel-button")).to_be_hidden()
    expect(page.locator("#job-error")).to_contain_text("cancel")
    expect(page.locator("#job-error")).to_have_class("muted")  # grey: what was asked for, not an error
    with live_server.client("web") as client:
        assert wait_for(client, job["id"], timeout=30)["status"] == "cancelled"
    screenshot(page, "cancelled.png")
    assert tab.problems == []


def test_the_page_requests_nothing_outside_the_server(live_server, tab, model_files):
    with live_server.client("web") as client:
        spec = {
            "arch": "tests.nets:mixed_net",
            "checkpoint": upload(client, model_files["checkpoint"]),
            "data": upload(client, model_files["data"]),
            "batch_size": 8,
            "outputs": ["checkpoint", "onnx"],
        }
        job = wait_for(client, submit(client, spec)["id"])
    assert job["status"] == "succeeded", job["error"]
    page = tab.page
    sign_in(page, f"{live_server.url}/")
    expect(page.locator(f"#jobs-body tr[data-job-id='{job['id']}'] .status")).to_have_text("succeeded")
    page.goto(f"{live_server.url}/jobs/{job['id']}")
    expect(page.frame_locator("#report-frame").locator("#onnx")).to_be_visible()
    with page.expect_download():
        page.click("[data-artifact=onnx]")
    assert any(url.startswith("blob:") or url.endswith("/artifacts/onnx") for url in tab.requested)
    assert tab.foreign_requests(live_server.url) == []
    assert tab.problems == []


PARSE_EVENTS = """async () => {
  const api = await import("/static/api.js");
  const chunks = ["id: 3\\r\\nevent: status\\r\\ndata: {\\"status\\":", "\\"running\\"}\\r\\n\\r\\n: keep-alive\\n\\n",
                  "id: 4\\nevent: progress\\ndata: {\\"a\\":\\ndata: 1}\\n\\nretry: 10\\n\\n"];
  const body = new ReadableStream({start(controller) {
    for (const chunk of chunks) controller.enqueue(new TextEncoder().encode(chunk));
    controller.close();
  }});
  const events = [];
  for await (const event of api.readEvents(body)) events.push(event);
  return {
    events,
    phase: api.progressText({samples_done: 3, samples_total: 5, phase: "calibrating"}),
    plain: api.progressText({samples_done: 7, samples_total: null}),
    finished: api.progressText({samples_done: 5, samples_total: 5, phase: "writing"}, "succeeded"),
  };
}"""


def test_the_stream_parser_and_the_progress_line_in_the_browser(live_server, tab):
    page = tab.page
    page.goto(f"{live_server.url}/")
    result = page.evaluate(PARSE_EVENTS)
    assert result["events"] == [
        {"id": "3", "event": "status", "data": '{"status":"running"}'},
        {"id": "4", "event": "progress", "data": '{"a":\n1}'},
    ]
    assert result["phase"] == "3 / 5 samples \u00b7 calibrating" and result["plain"] == "7 samples"
    assert result["finished"] == "5 / 5 samples"  # a finished job's last phase is not shown
    assert tab.problems == []


# --- plain HTTP -------------------------------------------------------------------------

ASSET = re.compile(r"""(?:src|href)="([^"]+)"|from\s+"(\./[^"]+)"|import\s+"(\./[^"]+)\"""")
EXTERNAL = re.compile(r"(?:https?:)?//[\w.-]+", re.IGNORECASE)


def assets_of(client: httpx.Client, path: str, seen: dict[str, str]) -> None:
    """``path`` and every script, stylesheet and module it names, recursively, into ``seen``."""
    if path in seen:
        return
    response = client.get(path)
    assert response.status_code == 200, path
    seen[path] = response.text
    for match in ASSET.finditer(response.text):
        target = next(group for group in match.groups() if group)
        if target.startswith(("data:", "#")) or target in ("/", "."):
            continue
        assets_of(client, urljoin(path, target), seen)


def test_the_page_is_served_with_a_strict_policy_and_refers_to_nothing_external(live_server):
    with live_server.client(None) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "default-src 'self'" in policy and "script-src 'self'" in policy and "unsafe" not in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        assert 'data-auth="true"' in page.text and 'id="key-panel"' in page.text
        frame = client.get("/ui/report-frame")
        assert "default-src 'none'" in frame.headers["content-security-policy"]
        served: dict[str, str] = {}
        for path in ("/", "/jobs/0123abc", "/ui/report-frame"):
            assets_of(client, path, served)
        assert {"/static/api.js", "/static/jobs.js", "/static/job.js", "/static/bnrecal.css"} <= set(served)
        for path, text in served.items():
            assert EXTERNAL.findall(text) == [], f"{path} refers outside the server"
        schema = client.get("/openapi.json").json()
    assert all(path.startswith("/v1/") or path in ("/healthz", "/readyz", "/metrics") for path in schema["paths"])


def test_without_api_keys_the_page_does_not_ask_for_one(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", api_keys=[])
    app = create_app(settings)
    app.state.services = SimpleNamespace(settings=settings)  # the page needs only the settings
    page = TestClient(app).get("/")  # no lifespan: no Ray, no ledger
    assert page.status_code == 200
    assert 'data-auth="false"' in page.text and "key-panel" not in page.text and "forget-key" not in page.text


def test_the_form_offers_one_checkbox_per_exported_file_from_the_products_table(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", api_keys=[])
    app = create_app(settings)
    app.state.services = SimpleNamespace(settings=settings)
    page = TestClient(app).get("/").text
    boxes = re.findall(r'<input id="([a-z0-9_]+)" name="outputs" value="([a-z0-9_]+)" type="checkbox"( data-int8)?>', page)
    assert [(name, value, bool(int8)) for name, value, int8 in boxes] == [
        (product.name, product.name, product.int8) for product in PRODUCTS
    ]
    for product in PRODUCTS:
        assert f'<label for="{product.name}">{product.label}</label>' in page
