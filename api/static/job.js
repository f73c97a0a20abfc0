// A job's page: what it ran on (file names, the spec in words), its times and phases, live
// status and progress, the failure, cancel / re-run / edit / delete, downloads named after
// the job, and the HTML report.

import {
  api, apiJson, config, describeError, el, followJob, isTerminal, progressText, requireKey, setProgress, setStatus,
} from "./api.js";
import {
  durationSeconds, formatSeconds, formatTime, inputDetail, inputFields, inputName, shortId, statisticsLine,
} from "./format.js";

const jobId = document.body.dataset.jobId;
const jobPath = `/v1/jobs/${encodeURIComponent(jobId)}`;
const MAX_REPORT_HEIGHT = 50_000; // px; the frame scrolls past this
const INPUT_LABELS = { program: "program", checkpoint: "checkpoint", data: "calibration data", "eval.data": "evaluation data" };
let job = null;
let following = false;
let reportShown = false;

function showProblem(message) {
  const box = document.getElementById("job-problem");
  box.textContent = message;
  box.hidden = !message;
}

function showState(state) {
  job = { ...(job || {}), ...state };
  setStatus(document.getElementById("job-status"), state.status);
  const bar = document.getElementById("job-progress");
  bar.hidden = isTerminal(state.status);
  setProgress(bar, state.progress, state.status);
  document.getElementById("job-progress-text").textContent = isTerminal(state.status) ? "" : progressText(state.progress, state.status);
  document.getElementById("job-actions").hidden = false;
  document.getElementById("cancel-button").hidden = isTerminal(state.status);
  document.getElementById("delete-button").hidden = !isTerminal(state.status);
  showError(state);
  showDuration();
  document.body.dataset.status = state.status;
}

/** A failure in red with its field; a cancellation in grey: it is what the user asked for. */
function showError(state) {
  const box = document.getElementById("job-error");
  box.hidden = !state.error;
  box.className = state.status === "cancelled" ? "muted" : "error";
  if (!state.error) return;
  const { title, detail, field, rank, node } = state.error;
  const where = [field ? `field ${field}` : "", rank !== undefined ? `rank ${rank}` : "", node ? `node ${node}` : ""]
    .filter(Boolean).join(", ");
  box.textContent = `${title}: ${detail}${where ? `\n(${where})` : ""}`;
}

function showDuration() {
  const seconds = job && durationSeconds(job);
  document.getElementById("job-duration").textContent = seconds === null || seconds === undefined
    ? "" : `${job.finished_at ? "took" : "running for"} ${formatSeconds(seconds)}`;
}

function rows(list, entries) {
  list.replaceChildren(...entries.flatMap(([name, value, title]) => [
    el("dt", {}, name), el("dd", title ? { title } : {}, value),
  ]));
}

function showInputs(current) {
  rows(document.getElementById("job-inputs"), inputFields(current).map((field) => [
    INPUT_LABELS[field] || field, inputName(current, field), inputDetail(current, field),
  ]));
}

/** The spec in words: only what was asked for (no ONNX options without an ONNX export). */
function showSpec(spec) {
  const entries = [];
  if (spec.models || spec.datasets) {
    const models = spec.models ? spec.models.length : 1;
    const sets = spec.datasets ? Object.keys(spec.datasets).length : 1;
    entries.push(["sweep", `${models} model(s) × ${sets} set(s)${spec.pairs ? `, ${spec.pairs.length} cells listed` : ""}`]);
  }
  if (spec.arch) entries.push(["architecture", spec.arch]);
  if (spec.model_kwargs && Object.keys(spec.model_kwargs).length) {
    entries.push(["model kwargs", Object.entries(spec.model_kwargs).map(([k, v]) => `${k} = ${JSON.stringify(v)}`).join(", ")]);
  }
  entries.push(["mode", spec.mode === "sync" ? "sync (global-batch statistics)" : "local (per-worker statistics)"]);
  entries.push(["workers", `${spec.workers}${spec.device ? ` on ${spec.device}` : ""}`]);
  entries.push(["batch size", `${spec.batch_size}`]);
  entries.push(["samples", spec.max_samples === "auto"
    ? `until the statistics converge (\u00b1${((spec.tolerance || 0.05) * 100).toFixed(1)}%)`
    : spec.max_samples ? `the first ${spec.max_samples}` : "all"]);
  entries.push(["order", spec.order === "given" ? "given (file order)" : `shuffled (seed ${spec.seed || 0})`]);
  if (spec.eval) entries.push(["evaluation", spec.eval.max_samples ? `the first ${spec.eval.max_samples} samples` : "all samples"]);
  const outputs = spec.outputs || [];
  entries.push(["outputs", [...outputs, "report"].join(", ")]);
  if (outputs.includes("onnx") && spec.onnx) {
    const onnx = spec.onnx;
    entries.push(["ONNX", `opset ${onnx.opset}, ${onnx.dtype}, ${onnx.dynamic_batch ? "dynamic" : "fixed"} batch`
      + (onnx.input_shape ? `, input ${onnx.input_shape.join("×")}` : "")]);
  }
  if (outputs.includes("onnx_int8") || outputs.includes("openvino_int8")) {
    const int8 = spec.int8 || {};
    entries.push(["INT8", `for ${int8.target || "onnxruntime"}, ${int8.method || "minmax"} ranges, weights int8 ${int8.per_channel === false ? "per tensor" : "per channel"}, `
      + `${int8.reduce_range === false || (int8.reduce_range == null && int8.target === "tensorrt") ? "8-bit" : "7-bit"}`
      + (int8.max_top1_drop != null ? `, top-1 drop at most ${int8.max_top1_drop} points` : "")]);
  }
  if (spec.transform) entries.push(["transform", JSON.stringify(spec.transform)]);
  rows(document.getElementById("job-spec"), entries);
}

function showTimes(current) {
  const seconds = durationSeconds(current);
  rows(document.getElementById("job-times"), [
    ["created", formatTime(current.created_at), current.created_at],
    ["started", current.started_at ? formatTime(current.started_at) : "not yet", current.started_at],
    ["finished", current.finished_at ? formatTime(current.finished_at) : "not yet", current.finished_at],
    ["duration", seconds === null ? "" : formatSeconds(seconds)],
  ]);
  const table = document.getElementById("job-phases");
  table.hidden = !(current.phases && current.phases.length);
  table.tBodies[0].replaceChildren(...(current.phases || []).map((phase) => el(
    "tr", {},
    el("td", {}, phase.phase),
    el("td", { className: "muted" }, formatTime(phase.started_at)),
    el("td", {}, phase.seconds === null ? "…" : formatSeconds(phase.seconds)),
  )));
}

/** The name a download gets: the job's short id, a sweep's cell (model-set-), then the artifact's file name. */
function downloadName(name, artifact) {
  const cell = name.includes("/") ? `${name.slice(0, name.lastIndexOf("/")).replaceAll("/", "-")}-` : "";
  return `${shortId(jobId)}-${cell}${artifact.filename}`;
}

/** Fetch an artifact with the key and hand it to the browser as a download from a blob: URL. */
async function download(name, artifact) {
  try {
    const response = await api(`${jobPath}/artifacts/${encodeURIComponent(name)}`);
    const url = URL.createObjectURL(await response.blob());
    const link = el("a", { href: url, download: downloadName(name, artifact) });
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
      const button = el("button", { type: "button", className: "link", "data-artifact": name }, downloadName(name, artifact));
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

/**
 * A sweep's matrix: models down, sets across, each cell its value of the metric the sweep
 * ranks by (or its state), filled in as cells finish.
 */
function showMatrix(report) {
  const panel = document.getElementById("matrix-panel");
  const isSweep = report && Array.isArray(report.cells) && Array.isArray(report.models) && Array.isArray(report.sets);
  panel.hidden = !isSweep;
  if (!isSweep) return;
  const cells = new Map(report.cells.map((cell) => [`${cell.model}/${cell.set}`, cell]));
  const metric = report.rank_by;
  const value = (cell) => {
    const number = cell[metric];
    if (cell.status !== "succeeded" || number === null || number === undefined) return cell.status;
    return metric.endsWith("top1") || metric === "top1_gain" || metric === "prediction_change"
      ? `${(100 * number).toFixed(1)}%` : Number(number).toPrecision(3);
  };
  const head = el("tr", {}, el("th", {}, "model"), ...report.sets.map((name) => el("th", {}, name)));
  const rowsOf = report.models.map((model) => el("tr", {}, el("th", {}, model), ...report.sets.map((name) => {
    const cell = cells.get(`${model}/${name}`);
    if (!cell) return el("td", { className: "muted", "data-cell": `${model}/${name}` }, "·");
    return el("td", {
      className: `cell cell-${cell.status}`, "data-cell": `${model}/${name}`, title: cell.error || `${model} / ${name}`,
    }, value(cell));
  })));
  document.getElementById("sweep-matrix").replaceChildren(head, ...rowsOf);
  const done = report.cells.length;
  document.getElementById("matrix-summary").textContent =
    `${done} cell(s) done: ${report.succeeded} succeeded, ${report.failed} failed; ranked by ${metric}`;
}

let refreshing = false;
let refreshAgain = false;

/** A sweep's cell finished: its files and the matrix as the job now has them (one request at a time). */
function refreshSweep() {
  if (refreshing) {
    refreshAgain = true;
    return;
  }
  refreshing = true;
  apiJson(jobPath).then((current) => {
    showArtifacts(current.artifacts);
    showMatrix(current.report);
  }, () => {}).finally(() => {
    refreshing = false;
    if (refreshAgain) {
      refreshAgain = false;
      refreshSweep();
    }
  });
}

function showJob(current) {
  job = current;
  showState(current);
  showInputs(current);
  showSpec(current.spec);
  showTimes(current);
  showArtifacts(current.artifacts);
  showMatrix(current.report);
  const statistics = document.getElementById("job-statistics");
  statistics.textContent = statisticsLine(current.report);
  statistics.hidden = !statistics.textContent;
  if (current.status === "succeeded" && current.artifacts["report.html"]) {
    showReport().catch((error) => showProblem(describeError(error)));
  }
}

async function load() {
  let current;
  try {
    current = await apiJson(jobPath);
  } catch (error) {
    const badge = document.getElementById("job-status");
    badge.textContent = error.status === 404 ? "not found" : "error";
    badge.className = "status status-missing";
    document.getElementById("job-progress").hidden = true;
    throw error;
  }
  showJob(current);
  if (!isTerminal(current.status) && !following) {
    following = true;
    try {
      await followJob(jobId, (state, kind) => {
        if (kind === "cell") {
          refreshSweep();
          return;
        }
        const startedNow = state.status !== job.status;
        showState(state);
        if (startedNow) apiJson(jobPath).then(showTimes, () => {});
      });
    } finally {
      following = false;
    }
    showJob(await apiJson(jobPath)); // the final resource: artifacts, error, report, times
  }
}

async function act(button, run) {
  const state = document.getElementById("action-state");
  button.disabled = true;
  try {
    await run(state);
  } catch (error) {
    showProblem(describeError(error));
  } finally {
    button.disabled = false;
  }
}

function cancel() {
  if (!window.confirm(`Cancel job ${shortId(jobId)}? Its workers are stopped; it cannot be resumed.`)) return;
  act(document.getElementById("cancel-button"), async (state) => {
    state.textContent = "cancelling…";
    showState(await apiJson(`${jobPath}/cancel`, { method: "POST" }));
    state.textContent = "";
  });
}

function rerun() {
  act(document.getElementById("rerun-button"), async (state) => {
    state.textContent = "submitting…";
    const again = await apiJson("/v1/jobs", {
      method: "POST", body: JSON.stringify(job.spec), headers: { "Content-Type": "application/json" },
    });
    location.assign(`${config.root}/jobs/${encodeURIComponent(again.id)}`);
  });
}

function remove() {
  if (!window.confirm(`Delete job ${shortId(jobId)} and its downloads? Its input files stay on the server.`)) return;
  act(document.getElementById("delete-button"), async (state) => {
    await api(jobPath, { method: "DELETE" });
    state.textContent = "deleted";
    location.assign(`${config.root}/`);
  });
}

requireKey(() => {
  document.getElementById("cancel-button").addEventListener("click", cancel);
  document.getElementById("rerun-button").addEventListener("click", rerun);
  document.getElementById("delete-button").addEventListener("click", remove);
  document.getElementById("edit-link").href = `${config.root}/?edit=${encodeURIComponent(jobId)}`;
  setInterval(() => { if (job && job.status === "running") showDuration(); }, 1000);
  load().catch((error) => showProblem(describeError(error)));
});
