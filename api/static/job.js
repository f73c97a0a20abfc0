// A job's page: spec, live status and progress, cancel, downloads, and the HTML report.

import {
  api, apiJson, config, describeError, el, followJob, isTerminal, progressText, requireKey, setProgress, setStatus,
} from "./api.js";

const jobId = document.body.dataset.jobId;
const jobPath = `/v1/jobs/${encodeURIComponent(jobId)}`;
const SPEC_FIELDS = ["arch", "model_kwargs", "mode", "workers", "batch_size", "max_samples", "device", "outputs",
  "checkpoint", "program", "data", "eval", "transform", "onnx"];
const MAX_REPORT_HEIGHT = 50_000; // px; the frame scrolls past this
let following = false;
let reportShown = false;

function showProblem(message) {
  const box = document.getElementById("job-problem");
  box.textContent = message;
  box.hidden = !message;
}

function showState(state) {
  setStatus(document.getElementById("job-status"), state.status);
  setProgress(document.getElementById("job-progress"), state.progress, state.status);
  document.getElementById("job-progress-text").textContent = progressText(state.progress, state.status);
  document.getElementById("cancel-button").hidden = isTerminal(state.status);
  const errorBox = document.getElementById("job-error");
  errorBox.hidden = !state.error;
  errorBox.textContent = state.error ? `${state.error.title}: ${state.error.detail}` : "";
  document.body.dataset.status = state.status;
}

function specValue(value) {
  return typeof value === "object" && value !== null ? JSON.stringify(value) : `${value}`;
}

function showSpec(spec) {
  const list = document.getElementById("job-spec");
  list.replaceChildren();
  for (const name of SPEC_FIELDS) {
    if (spec[name] === undefined || spec[name] === null) continue;
    list.append(el("dt", {}, name), el("dd", {}, specValue(spec[name])));
  }
}

/** Fetch an artifact with the key and hand it to the browser as a download from a blob: URL. */
async function download(name, artifact) {
  try {
    const response = await api(`${jobPath}/artifacts/${encodeURIComponent(name)}`);
    const url = URL.createObjectURL(await response.blob());
    const link = el("a", { href: url, download: artifact.filename });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
  } catch (error) {
    showProblem(describeError(error));
  }
}

function showArtifacts(artifacts) {
  const list = document.getElementById("artifacts");
  const names = Object.keys(artifacts || {});
  list.replaceChildren(
    ...names.map((name) => {
      const artifact = artifacts[name];
      const button = el("button", { type: "button", className: "link", "data-artifact": name }, artifact.filename);
      button.addEventListener("click", () => download(name, artifact));
      return el("li", {}, button, " ", el("span", { className: "muted" }, `${name}, ${artifact.size} bytes`));
    }),
  );
  document.getElementById("artifacts-panel").hidden = names.length === 0;
}

/**
 * Show report.html in a sandboxed frame (scripts allowed, same origin not: it cannot see
 * this page's storage). The frame has its own strict policy that lets the report's inline
 * styles apply; the HTML is handed to it by postMessage once it says it is ready.
 */
async function showReport() {
  if (reportShown) return;
  reportShown = true;
  const response = await api(`${jobPath}/artifacts/report.html`);
  const html = await response.text();
  const frame = document.getElementById("report-frame");
  window.addEventListener("message", (event) => {
    if (event.source !== frame.contentWindow) return;
    if (event.data === "bnrecal-report-frame-ready") {
      frame.contentWindow.postMessage({ kind: "bnrecal-report", html }, "*");
    } else if (event.data && event.data.kind === "bnrecal-report-height") {
      const height = Math.min(Math.max(Number(event.data.height) || 0, 200), MAX_REPORT_HEIGHT);
      frame.style.height = `${height + 4}px`;
    }
  });
  frame.src = `${config.root}/ui/report-frame`;
  document.getElementById("report-panel").hidden = false;
}

function showJob(job) {
  showState(job);
  showSpec(job.spec);
  showArtifacts(job.artifacts);
  if (job.status === "succeeded" && job.artifacts["report.html"]) {
    showReport().catch((error) => showProblem(describeError(error)));
  }
}

async function load() {
  const job = await apiJson(jobPath);
  showJob(job);
  if (!isTerminal(job.status) && !following) {
    following = true;
    try {
      await followJob(jobId, showState);
    } finally {
      following = false;
    }
    showJob(await apiJson(jobPath)); // the final resource: artifacts, error, report
  }
}

async function cancel() {
  const button = document.getElementById("cancel-button");
  button.disabled = true;
  try {
    showState(await apiJson(`${jobPath}/cancel`, { method: "POST" }));
  } catch (error) {
    showProblem(describeError(error));
  } finally {
    button.disabled = false;
  }
}

requireKey(() => {
  document.getElementById("cancel-button").addEventListener("click", cancel);
  load().catch((error) => showProblem(describeError(error)));
});
