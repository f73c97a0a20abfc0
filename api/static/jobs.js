// The jobs page: this key's jobs, newest first, kept live by one change stream
// (GET /v1/jobs/events), filtered by status and paged; and the form that submits a job,
// uploading only the files the server does not have yet, after a dry run of the spec.

import {
  ApiError, api, apiJson, config, describeError, el, fileDigest, followChanges, hasBlob, isTerminal,
  progressText, requireKey, setProgress, setStatus, uploadFile,
} from "./api.js";
import {
  durationSeconds, formatSeconds, formatTime, inputDetail, inputFields, inputName, modelName, resultText,
  runShape, shortId,
} from "./format.js";

const PAGE_SIZE = 50;
const body = document.getElementById("jobs-body");
const filter = document.getElementById("status-filter");
const moreButton = document.getElementById("more-jobs");
let nextCursor = null;

// --- the list ----------------------------------------------------------------------------

function inputsCell(job) {
  const cell = el("td", { className: "inputs" });
  for (const field of inputFields(job)) {
    cell.append(el("span", { className: "input", title: `${field}: ${inputDetail(job, field)}` }, inputName(job, field)));
  }
  return cell;
}

function jobRow(job) {
  const href = `${config.root}/jobs/${encodeURIComponent(job.id)}`;
  const row = el(
    "tr",
    { "data-job-id": job.id },
    el("td", {}, el("a", { href }, el("code", {}, shortId(job.id)))),
    inputsCell(job),
    el("td", { className: "model" }, modelName(job)),
    el("td", { className: "run" }, runShape(job.spec)),
    el("td", {}, el("span", { className: "status" })),
    el("td", { className: "progress" }, el("progress", { max: 1, value: 0 }), " ",
      el("span", { className: "progress-text" })),
    el("td", { className: "duration" }),
    el("td", { className: "created muted" }, formatTime(job.created_at)),
  );
  updateRow(row, job);
  return row;
}

function updateRow(row, job) {
  if (row.job && row.job.revision > job.revision) return; // an older view (a list read before an event)
  row.job = job;
  row.dataset.status = job.status;
  row.dataset.created = job.created_at;
  setStatus(row.querySelector(".status"), job.status);
  const bar = row.querySelector("progress");
  bar.hidden = isTerminal(job.status);
  setProgress(bar, job.progress, job.status);
  const text = row.querySelector(".progress-text");
  text.textContent = isTerminal(job.status) ? resultText(job) : job.status === "queued" ? "waiting" : progressText(job.progress);
  text.className = `progress-text ${job.status === "failed" ? "error" : "muted"}`;
  text.title = job.error ? `${job.error.title}: ${job.error.detail}` : "";
  showDuration(row);
}

function showDuration(row) {
  const seconds = durationSeconds(row.job);
  row.querySelector(".duration").textContent = seconds === null ? "" : formatSeconds(seconds);
}

function matchesFilter(job) {
  return !filter.value || job.status === filter.value;
}

function rowOf(id) {
  return body.querySelector(`tr[data-job-id="${CSS.escape(id)}"]`);
}

/** A job from the change stream: update its row, or add it in its place (newest first). */
function upsert(job) {
  const row = rowOf(job.id);
  if (!matchesFilter(job)) {
    if (row) row.remove();
  } else if (row) {
    updateRow(row, job);
  } else {
    const fresh = jobRow(job);
    const older = [...body.rows].find((other) => other.dataset.created <= job.created_at);
    if (older) body.insertBefore(fresh, older);
    else if (!nextCursor) body.append(fresh); // beyond the loaded pages it shows up when paged to
  }
  showEmpty();
}

function showEmpty() {
  document.getElementById("jobs-empty").hidden = body.rows.length > 0;
}

/** The "New job" form, opened (it starts folded under the list's heading line). */
function openForm() {
  document.getElementById("new-job").open = true;
}

function showJobsError(message) {
  const box = document.getElementById("jobs-error");
  box.textContent = message;
  box.hidden = !message;
}

async function loadJobs(append = false) {
  const params = new URLSearchParams({ limit: PAGE_SIZE });
  if (filter.value) params.set("status", filter.value);
  if (append && nextCursor) params.set("cursor", nextCursor);
  const page = await apiJson(`/v1/jobs?${params}`);
  const existing = new Map([...body.rows].map((row) => [row.dataset.jobId, row]));
  const rows = page.jobs.map((job) => {
    const row = existing.get(job.id);
    if (!row) return jobRow(job);
    updateRow(row, job); // kept if an event already showed a newer state
    return row;
  });
  if (append) {
    body.append(...rows.filter((row) => !row.isConnected));
  } else { // jobs the stream showed that were created after this list was read stay on top
    const listed = new Set(page.jobs.map((job) => job.id));
    const newest = page.jobs.length ? page.jobs[0].created_at : "";
    const newer = [...body.rows].filter((row) => !listed.has(row.dataset.jobId) && row.dataset.created > newest
      && matchesFilter(row.job));
    body.replaceChildren(...newer, ...rows);
  }
  nextCursor = page.next_cursor;
  moreButton.hidden = !nextCursor;
  showEmpty();
  if (!body.dataset.loaded) { // the first list: a key with no jobs yet needs the form more than the list
    body.dataset.loaded = "yes";
    if (!body.rows.length && !filter.value) openForm();
  }
}

function listLive() {
  const state = document.getElementById("feed-state");
  followChanges((kind, data) => {
    if (kind === "ready") {
      state.textContent = "live";
      loadJobs().then(() => showJobsError(""), (error) => showJobsError(describeError(error)));
    } else if (kind === "job") {
      upsert(data);
    } else if (kind === "deleted") {
      const row = rowOf(data.id);
      if (row) row.remove();
      showEmpty();
    }
  }).catch((error) => {
    state.textContent = "";
    showJobsError(`${describeError(error)} (the list no longer updates by itself: reload the page)`);
  });
  setInterval(() => body.querySelectorAll('tr[data-status="running"]').forEach(showDuration), 1000);
}

// --- the form ----------------------------------------------------------------------------

class FormError extends Error {}

const FILE_FIELDS = { checkpoint: "checkpoint", program: "program", data: "data", "eval-data": "eval.data" };
const kept = {}; // input id -> {digest, filename}: a blob of the job being edited, used again as it is

function intField(id) {
  const input = document.getElementById(id);
  if (input.value.trim() === "") return undefined;
  const number = Number(input.value);
  return Number.isFinite(number) ? number : input.value; // the API says what is wrong with it
}

/** Max samples: a number, "auto", or all (empty). */
function samplesField(id) {
  const text = document.getElementById(id).value.trim();
  return text.toLowerCase() === "auto" ? "auto" : intField(id);
}

/** A text field, or undefined when empty (the option's default). */
function textField(id) {
  const text = document.getElementById(id).value.trim();
  return text === "" ? undefined : text;
}

function numberField(id) {
  const input = document.getElementById(id);
  if (input.value.trim() === "") return undefined;
  const number = Number(input.value);
  return Number.isFinite(number) ? number : input.value;
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

function modelKind() {
  return document.getElementById("model-kind").value;
}

function showModelKind() {
  const kind = modelKind();
  document.querySelectorAll("[data-kind]").forEach((node) => {
    node.hidden = node.dataset.kind !== kind;
  });
}

/** The file chosen for an input, or the kept blob of the job being edited, or neither. */
function source(id, label, required) {
  const file = document.getElementById(id).files[0];
  if (file) return { id, file };
  if (kept[id]) return { id, digest: kept[id].digest };
  if (required) throw new FormError(`choose a ${label} file`);
  return null;
}

function uploadBar(id) {
  return document.querySelector(`progress[data-upload="${id}"]`);
}

/** The form's checkboxes of exported files, one per product (the page renders them from the products table). */
function outputBoxes() {
  return [...document.querySelectorAll('input[name="outputs"]')];
}

/** The spec the form describes, and the files it names: each hashed here, so the spec names
 * blobs by digest before anything is uploaded. */
async function describe(state) {
  const kind = modelKind();
  const sources = {};
  if (kind === "program") sources.program = source("program", "program", true);
  else sources.checkpoint = source("checkpoint", "checkpoint", true);
  sources.data = source("data", "calibration data", true);
  sources["eval-data"] = source("eval-data", "evaluation data", false);
  const spec = {
    mode: document.getElementById("mode").value,
    workers: intField("workers"),
    batch_size: intField("batch-size"),
    max_samples: samplesField("max-samples"),
    tolerance: numberField("tolerance"),
    order: document.getElementById("order").value,
    seed: intField("seed"),
    image_column: textField("image-column"),
    label_column: textField("label-column"),
    outputs: [kind, ...outputBoxes().filter((box) => box.checked).map((box) => box.value)],
  };
  if (outputBoxes().some((box) => box.checked && "int8" in box.dataset)) {
    spec.int8 = { method: document.getElementById("int8-method").value };
    const target = document.getElementById("int8-target").value;
    if (target !== "onnxruntime") spec.int8.target = target;
  }
  if (kind === "checkpoint") {
    spec.arch = document.getElementById("arch").value.trim();
    spec.model_kwargs = modelKwargs();
  }
  for (const item of Object.values(sources)) {
    if (item && item.file) {
      state.textContent = `hashing ${item.file.name}…`;
      item.digest = await fileDigest(item.file);
    }
  }
  const digest = (id) => (sources[id] ? sources[id].digest : undefined);
  if (kind === "program") spec.program = digest("program");
  else spec.checkpoint = digest("checkpoint");
  spec.data = digest("data");
  if (sources["eval-data"]) spec.eval = { data: digest("eval-data") };
  return { spec, files: Object.values(sources).filter((item) => item && item.file) };
}

const BLOB_FIELDS = new Set(Object.values(FILE_FIELDS));

/** Check the spec with a dry run before any upload. A blob the server does not have yet
 * is the one refusal that uploading fixes: the dry run is repeated once they are there. */
async function dryRun(spec, missing) {
  try {
    await apiJson("/v1/jobs?dry_run=true", {
      method: "POST", body: JSON.stringify(spec), headers: { "Content-Type": "application/json" },
    });
  } catch (error) {
    const field = error instanceof ApiError && error.problem.field;
    if (!(error.status === 422 && BLOB_FIELDS.has(field) && missing.size > 0)) throw error;
  }
}

async function upload(files, state) {
  const missing = [];
  for (const item of files) {
    if (item.digest && (await hasBlob(item.digest))) {
      state.textContent = `${item.file.name} is already on the server`;
      continue;
    }
    missing.push(item);
  }
  return missing;
}

async function submitJob(event) {
  event.preventDefault();
  const button = document.getElementById("submit-button");
  const state = document.getElementById("submit-state");
  const errorBox = document.getElementById("form-error");
  errorBox.hidden = true;
  button.disabled = true;
  document.querySelectorAll("progress.upload").forEach((bar) => { bar.hidden = true; });
  try {
    const { spec, files } = await describe(state);
    state.textContent = "checking the spec…";
    const missing = await upload(files, state);
    const hashed = files.every((item) => item.digest);
    if (hashed) await dryRun(spec, new Set(missing.map((item) => item.digest)));
    for (const item of missing) {
      const bar = uploadBar(item.id);
      bar.hidden = false;
      state.textContent = `uploading ${item.file.name}…`;
      const blob = await uploadFile(item.file, (sent, total) => { bar.max = total || 1; bar.value = sent; });
      item.digest = blob.digest;
    }
    if (!hashed) { // no SubtleCrypto here: the digests come from the uploads
      for (const item of files) {
        const field = FILE_FIELDS[item.id];
        if (field === "eval.data") spec.eval.data = item.digest;
        else spec[field] = item.digest;
      }
    }
    state.textContent = "submitting…";
    const job = await apiJson("/v1/jobs", {
      method: "POST", body: JSON.stringify(spec), headers: { "Content-Type": "application/json" },
    });
    const uploaded = missing.length ? `uploaded ${missing.map((item) => item.file.name).join(", ")}` : "nothing uploaded";
    state.textContent = `job ${shortId(job.id)} submitted (${uploaded})`;
    upsert(job);
  } catch (error) {
    state.textContent = "";
    errorBox.textContent = describeError(error);
    errorBox.hidden = false;
  } finally {
    button.disabled = false;
  }
}

/** "Edit and re-run": the form filled in from a job, its blobs kept (nothing uploaded again). */
async function editFrom(jobId) {
  const job = await apiJson(`/v1/jobs/${encodeURIComponent(jobId)}`);
  const spec = job.spec;
  openForm();
  document.getElementById("new-job").scrollIntoView();
  document.getElementById("form-title").textContent = `New job from ${shortId(job.id)}`;
  const note = document.getElementById("edit-note");
  note.textContent = "The files of that job are used again as they are on the server; choose a file only to replace one.";
  note.hidden = false;
  document.getElementById("model-kind").value = spec.program ? "program" : "checkpoint";
  showModelKind();
  if (spec.arch) document.getElementById("arch").value = spec.arch;
  document.getElementById("model-kwargs").value = JSON.stringify(spec.model_kwargs || {});
  document.getElementById("workers").value = spec.workers;
  document.getElementById("batch-size").value = spec.batch_size;
  document.getElementById("max-samples").value = spec.max_samples || "";
  document.getElementById("tolerance").value = spec.tolerance ?? "";
  document.getElementById("order").value = spec.order || "shuffled";
  document.getElementById("seed").value = spec.seed ?? 0;
  document.getElementById("image-column").value = spec.image_column || "";
  document.getElementById("label-column").value = spec.label_column || "";
  document.getElementById("mode").value = spec.mode;
  for (const box of outputBoxes()) box.checked = (spec.outputs || []).includes(box.value);
  document.getElementById("int8-method").value = (spec.int8 && spec.int8.method) || "minmax";
  document.getElementById("int8-target").value = (spec.int8 && spec.int8.target) || "onnxruntime";
  for (const [id, field] of Object.entries(FILE_FIELDS)) {
    const input = job.inputs[field];
    if (!input) continue;
    kept[id] = input;
    const label = document.querySelector(`[data-kept="${id}"]`);
    label.textContent = `keeps ${input.filename || input.digest.slice(0, 19)}`;
    label.title = input.digest;
    label.hidden = false;
  }
}

requireKey(() => {
  document.getElementById("submit-form").addEventListener("submit", submitJob);
  document.getElementById("model-kind").addEventListener("change", showModelKind);
  document.getElementById("program").addEventListener("change", () => {
    document.getElementById("model-kind").value = "program";
    showModelKind();
  });
  filter.addEventListener("change", () => loadJobs().catch((error) => showJobsError(describeError(error))));
  moreButton.addEventListener("click", () => loadJobs(true).catch((error) => showJobsError(describeError(error))));
  const edit = new URLSearchParams(location.search).get("edit");
  if (edit) editFrom(edit).catch((error) => showJobsError(describeError(error)));
  listLive();
});
