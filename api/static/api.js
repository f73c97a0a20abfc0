// Talking to the bnrecal API from the page: the API key (sessionStorage only), fetch with
// the Authorization header, problem+json errors, and job events over fetch() streams
// (EventSource cannot send a header).

const KEY_ITEM = "bnrecal.apiKey";
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const RECONNECT_MS = [500, 1000, 2000, 5000];

export const config = {
  auth: document.body.dataset.auth === "true",
  root: document.body.dataset.root || "",
};

export function isTerminal(status) {
  return TERMINAL.has(status);
}

/** The key of this tab's session, or null. Never stored elsewhere (no cookie, no URL). */
export function getKey() {
  return sessionStorage.getItem(KEY_ITEM);
}

function authHeaders(extra, key = getKey()) {
  const headers = new Headers(extra || {});
  if (config.auth && key) headers.set("Authorization", `Bearer ${key}`);
  return headers;
}

/** An error response of the API: its status and problem object (title, detail, field). */
export class ApiError extends Error {
  constructor(status, problem) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

async function problemOf(response) {
  let problem = { title: response.statusText, detail: "" };
  try {
    const text = await response.text();
    try {
      problem = JSON.parse(text);
    } catch {
      problem.detail = text.slice(0, 300);
    }
  } catch {
    // the body could not be read: the status says enough
  }
  return new ApiError(response.status, problem);
}

/** One line for the user: "401 Unauthorized: invalid API key". */
export function describeError(error) {
  if (error instanceof ApiError) {
    const title = error.problem.title || "Error";
    return `${error.status} ${title}: ${error.problem.detail || ""}`.trim();
  }
  return `${error && error.message ? error.message : error}`;
}

/** fetch() under the API root with the key; a non-2xx answer throws an ApiError (401 also asks for the key). */
export async function api(path, init = {}, key = undefined) {
  const response = await fetch(config.root + path, {
    ...init,
    headers: authHeaders(init.headers, key === undefined ? getKey() : key),
    credentials: "same-origin",
    cache: "no-store",
  });
  if (!response.ok) {
    const error = await problemOf(response);
    if (error.status === 401 && key === undefined) askForKey(describeError(error));
    throw error;
  }
  return response;
}

/** The JSON body of an API call. */
export async function apiJson(path, init = {}) {
  return (await api(path, init)).json();
}

// --- the key panel ---------------------------------------------------------------------

let started = false;

function show(element, visible) {
  if (element) element.hidden = !visible;
}

function askForKey(message) {
  if (!config.auth) return;
  sessionStorage.removeItem(KEY_ITEM);
  show(document.getElementById("key-panel"), true);
  show(document.getElementById("key-state"), false);
  show(document.getElementById("app"), false);
  const error = document.getElementById("key-error");
  error.textContent = message || "";
  show(error, Boolean(message));
  document.getElementById("key-input").focus();
}

function keyAccepted(start) {
  show(document.getElementById("key-panel"), false);
  show(document.getElementById("key-state"), true);
  show(document.getElementById("app"), true);
  if (started) {
    location.reload(); // the key changed under a running page: start it again cleanly
    return;
  }
  started = true;
  start();
}

/** Run ``start`` once the page can call the API: at once without keys, else once a key works. */
export function requireKey(start) {
  if (!config.auth) {
    started = true;
    start();
    return;
  }
  document.getElementById("forget-key").addEventListener("click", () => askForKey(""));
  document.getElementById("key-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const input = document.getElementById("key-input");
    const key = input.value.trim();
    if (!key) return;
    try {
      await api("/v1/jobs?limit=1", {}, key); // is it a key this server knows?
    } catch (error) {
      askForKey(describeError(error));
      return;
    }
    input.value = "";
    sessionStorage.setItem(KEY_ITEM, key);
    keyAccepted(start);
  });
  if (getKey()) keyAccepted(start);
  else askForKey("");
}

// --- Server-Sent Events over fetch() -----------------------------------------------------

/** Split a text/event-stream into events: {id, event, data}; comments and retry lines are skipped. */
export async function* readEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { id: null, event: "message", data: [] };
      for (const line of frame.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "id") event.id = value;
        else if (field === "event") event.event = value;
        else if (field === "data") event.data.push(value);
      }
      if (event.data.length) yield { ...event, data: event.data.join("\n") };
    }
  }
}

/**
 * Follow a job's events until its terminal status, calling ``onEvent(data, kind)`` for each;
 * reconnects with Last-Event-ID when the stream drops. Resolves with the last event's data,
 * rejects on an API error (404, 401) or when ``signal`` aborts.
 */
export async function followJob(jobId, onEvent, signal = undefined) {
  let lastEventId = null;
  let last = null;
  for (let attempt = 0; ; attempt++) {
    try {
      const headers = lastEventId ? { "Last-Event-ID": lastEventId } : {};
      const response = await api(`/v1/jobs/${encodeURIComponent(jobId)}/events`, { headers, signal });
      for await (const event of readEvents(response.body)) {
        if (event.event === "cell") { // a sweep's cell done: told, but not the job's state
          onEvent(JSON.parse(event.data), "cell");
          continue;
        }
        if (event.id) lastEventId = event.id;
        last = JSON.parse(event.data);
        attempt = 0;
        onEvent(last, event.event);
        if (isTerminal(last.status)) return last;
      }
    } catch (error) {
      if (error instanceof ApiError || (signal && signal.aborted)) throw error;
      // the connection dropped: try again below
    }
    const delay = RECONNECT_MS[Math.min(attempt, RECONNECT_MS.length - 1)];
    await new Promise((resolve) => setTimeout(resolve, delay));
  }
}

// --- small DOM helpers -------------------------------------------------------------------

/** An element with attributes and children (strings become text nodes: nothing is parsed as HTML). */
export function el(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "className") element.className = value;
    else element.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) element.append(child);
  }
  return element;
}

/** "3 / 5 samples · calibrating": the phase while the job runs (a finished job's is stale). */
export function progressText(progress, status = "running") {
  if (!progress) return "";
  const total = progress.samples_total;
  const counted = total ? `${progress.samples_done} / ${total} samples` : `${progress.samples_done} samples`;
  return progress.phase && status === "running" ? `${counted} · ${progress.phase}` : counted;
}

/** Set a <progress> element from a job's progress (indeterminate while the total is unknown). */
export function setProgress(bar, progress, status) {
  const total = progress && progress.samples_total;
  if (total) {
    bar.max = total;
    bar.value = Math.min(progress.samples_done, total);
  } else if (status === "running") {
    bar.removeAttribute("value");
  } else {
    bar.max = 1;
    bar.value = status === "succeeded" ? 1 : 0;
  }
}

/** Show a status as a labelled badge. */
export function setStatus(element, status) {
  element.textContent = status;
  element.className = `status status-${status}`;
}

// --- the key's change stream --------------------------------------------------------------

/**
 * Follow every change of this key's jobs (``GET /v1/jobs/events``) for as long as the page is
 * open: ``onEvent(kind, data)`` gets ``ready`` (list the jobs then: after it nothing is
 * missed), ``job`` (a job resource) and ``deleted`` ({id}); a dropped stream is reopened and
 * says ``ready`` again. Rejects only on an API error (401, 429).
 */
export async function followChanges(onEvent) {
  for (let attempt = 0; ; attempt++) {
    try {
      const response = await api("/v1/jobs/events");
      for await (const event of readEvents(response.body)) {
        attempt = 0;
        onEvent(event.event, JSON.parse(event.data));
      }
    } catch (error) {
      if (error instanceof ApiError) throw error;
      // the connection dropped: open it again below
    }
    const delay = RECONNECT_MS[Math.min(attempt, RECONNECT_MS.length - 1)];
    await new Promise((resolve) => setTimeout(resolve, delay));
  }
}

// --- uploads that do not repeat themselves ------------------------------------------------

/** The file's "sha256:<hex>" digest, as the server names blobs (null where the browser has no
 * SubtleCrypto: a page served over plain HTTP to another host). */
export async function fileDigest(file) {
  if (!globalThis.crypto || !crypto.subtle) return null;
  const hash = await crypto.subtle.digest("SHA-256", await file.arrayBuffer());
  return `sha256:${[...new Uint8Array(hash)].map((byte) => byte.toString(16).padStart(2, "0")).join("")}`;
}

/** Whether this key already has the blob (``HEAD /v1/blobs/{digest}``: 200 or 404). */
export async function hasBlob(digest) {
  const response = await fetch(`${config.root}/v1/blobs/${digest}`, { // a digest this page computed
    method: "HEAD",
    headers: authHeaders({}),
    credentials: "same-origin",
    cache: "no-store",
  });
  if (response.status === 404) return false;
  if (!response.ok) throw await problemOf(response);
  return true;
}

/** Upload a file as a blob with its name, calling ``onProgress(sent, total)``; resolves with
 * the blob ({digest, size, filename}). XMLHttpRequest, since fetch() reports no upload progress. */
export function uploadFile(file, onProgress) {
  return new Promise((resolve, reject) => {
    const request = new XMLHttpRequest();
    request.open("POST", `${config.root}/v1/blobs?filename=${encodeURIComponent(file.name.slice(0, 255))}`);
    authHeaders({ "Content-Type": "application/octet-stream" }).forEach((value, name) => {
      request.setRequestHeader(name, value);
    });
    request.upload.addEventListener("progress", (event) => onProgress(event.loaded, event.total || file.size));
    request.addEventListener("load", () => {
      let body = {};
      try {
        body = JSON.parse(request.responseText);
      } catch {
        body = { title: request.statusText, detail: request.responseText.slice(0, 300) };
      }
      if (request.status >= 200 && request.status < 300) {
        onProgress(file.size, file.size);
        resolve(body);
      } else {
        reject(new ApiError(request.status, body));
      }
    });
    request.addEventListener("error", () => reject(new Error(`upload of ${file.name} failed: the connection dropped`)));
    request.send(file);
  });
}
