// The jobs page: this key's jobs, newest first, with live progress, and the form that
// uploads a checkpoint (or a torch.export program) and data and submits a job.

import {
  api, apiJson, config, describeError, el, followJob, isTerminal, progressText, requireKey, setProgress, setStatus,
} from "./api.js";

const MAX_LIVE_STREAMS = 4; // the browser allows 6 connections to one origin: keep some free
const REFRESH_MS = 5000; // how often jobs beyond the live streams are refreshed
const live = new Set();

const body = document.getElementById("jobs-body");

function jobRow(job) {
  const bar = el("progress", { max: 1, value: 0 });
  const jobHref = `${config.root}/jobs/${encodeURIComponent(job.id)}`;
  const row = el(
    "tr",
    { "data-job-id": job.id },
    el("td", {}, el("a", { href: jobHref }, el("code", {}, job.id.slice(0, 12)))),
    el("td", {}, job.spec.arch || (job.spec.program ? "program" : "")),
    el("td", {}, el("span", { className: "status" })),
    el("td", { className: "progress" }, bar, " ", el("span", { className: "progress-text muted" })),
    el("td", { className: "muted" }, new Date(job.created_at).toLocaleString()),
  );
  updateRow(row, job);
  return row;
}

function updateRow(row, state) {
  setStatus(row.querySelector(".status"), state.status);
  setProgress(row.querySelector("progress"), state.progress, state.status);
  row.querySelector(".progress-text").textContent = progressText(state.progress, state.status);
  row.dataset.status = state.status;
}

function follow(job, row) {
  if (isTerminal(job.status) || live.has(job.id) || live.size >= MAX_LIVE_STREAMS) return;
  live.add(job.id);
  followJob(job.id, (state) => updateRow(row, state))
    .catch((error) => showJobsError(describeError(error)))
    .finally(() => live.delete(job.id));
}

function showJobsError(message) {
  const box = document.getElementById("jobs-error");
  box.textContent = message;
  box.hidden = !message;
}

async function loadJobs() {
  const { jobs } = await apiJson("/v1/jobs?limit=50");
  const rows = new Map([...body.querySelectorAll("tr")].map((row) => [row.dataset.jobId, row]));
  body.replaceChildren(
    ...jobs.map((job) => {
      let row = rows.get(job.id);
      if (row) updateRow(row, job);
      else row = jobRow(job);
      return row;
    }),
  );
  document.getElementById("jobs-empty").hidden = jobs.length > 0;
  jobs.forEach((job) => follow(job, body.querySelector(`tr[data-job-id="${CSS.escape(job.id)}"]`)));
  return jobs.filter((job) => !isTerminal(job.status) && !live.has(job.id)).length;
}

async function refreshLoop() {
  try {
    const unfollowed = await loadJobs();
    showJobsError("");
    if (unfollowed > 0) setTimeout(refreshLoop, REFRESH_MS);
  } catch (error) {
    showJobsError(describeError(error));
  }
}

// --- the form ----------------------------------------------------------------------------

class FormError extends Error {}

function intField(id) {
  const input = document.getElementById(id);
  if (input.value.trim() === "") return undefined;
  const number = Number(input.value);
  return Number.isFinite(number) ? number : input.value; // the API says what is wrong with it
}

function chosenFile(id, label, required) {
  const file = document.getElementById(id).files[0];
  if (!file && required) throw new FormError(`choose a ${label} file`);
  return file;
}

async function uploadBlob(file, label, state) {
  state.textContent = `uploading ${label} (${file.name}, ${file.size} bytes)…`;
  // the file's name is only shown in the errors of jobs that use the blob
  const response = await api(`/v1/blobs?filename=${encodeURIComponent(file.name.slice(0, 255))}`, {
    method: "POST",
    body: file,
    headers: { "Content-Type": "application/octet-stream" },
  });
  return (await response.json()).digest;
}

function modelKwargs() {
  const text = document.getElementById("model-kwargs").value.trim();
  if (!text) return {};
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    throw new FormError(`model_kwargs: not valid JSON (${error.message})`);
  }
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    throw new FormError("model_kwargs: must be a JSON object, e.g. {\"num_classes\": 10}");
  }
  return value;
}

/** The job spec the form describes, uploading its files first. */
async function buildSpec(state) {
  // a program carries its architecture and weights; otherwise an architecture and a checkpoint
  const programFile = chosenFile("program", "program", false);
  const checkpointFile = programFile ? undefined : chosenFile("checkpoint", "checkpoint (or a program)", true);
  const dataFile = chosenFile("data", "calibration data", true);
  const evalFile = chosenFile("eval-data", "evaluation data", false);
  const model = programFile ? "program" : "checkpoint";
  const spec = {
    mode: document.getElementById("mode").value,
    workers: intField("workers"),
    batch_size: intField("batch-size"),
    max_samples: intField("max-samples"),
    outputs: document.getElementById("onnx").checked ? [model, "onnx"] : [model],
  };
  if (programFile) {
    spec.program = await uploadBlob(programFile, "program", state);
  } else {
    spec.arch = document.getElementById("arch").value.trim();
    spec.model_kwargs = modelKwargs();
    spec.checkpoint = await uploadBlob(checkpointFile, "checkpoint", state);
  }
  spec.data = await uploadBlob(dataFile, "data", state);
  if (evalFile) spec.eval = { data: await uploadBlob(evalFile, "evaluation data", state) };
  return spec;
}

async function submitJob(event) {
  event.preventDefault();
  const button = document.getElementById("submit-button");
  const state = document.getElementById("submit-state");
  const errorBox = document.getElementById("form-error");
  errorBox.hidden = true;
  button.disabled = true;
  try {
    const spec = await buildSpec(state);
    state.textContent = "submitting…";
    const job = await apiJson("/v1/jobs", {
      method: "POST",
      body: JSON.stringify(spec),
      headers: { "Content-Type": "application/json" },
    });
    state.textContent = `job ${job.id.slice(0, 12)} submitted`;
    const row = jobRow(job);
    body.prepend(row);
    document.getElementById("jobs-empty").hidden = true;
    follow(job, row);
  } catch (error) {
    state.textContent = "";
    errorBox.textContent = describeError(error);
    errorBox.hidden = false;
  } finally {
    button.disabled = false;
  }
}

requireKey(() => {
  document.getElementById("submit-form").addEventListener("submit", submitJob);
  refreshLoop();
});
