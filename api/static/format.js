// What the pages say about a job, in words: its inputs, model, run shape, duration and result.
// Shared by the jobs list and the job page (plain functions of the job resource).

/** "1.2 s", "3 min 12 s", "1 h 04 min". */
export function formatSeconds(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "";
  if (seconds < 10) return `${seconds.toFixed(1)} s`;
  if (seconds < 60) return `${Math.round(seconds)} s`;
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) return `${minutes} min ${String(Math.round(seconds % 60)).padStart(2, "0")} s`;
  return `${Math.floor(minutes / 60)} h ${String(minutes % 60).padStart(2, "0")} min`;
}

/** How long the job ran (until now while it runs); null before it started. */
export function durationSeconds(job, now = Date.now()) {
  if (!job.started_at) return null;
  const end = job.finished_at ? Date.parse(job.finished_at) : now;
  return Math.max(0, (end - Date.parse(job.started_at)) / 1000);
}

/** A date and time in the reader's locale, with its time zone ("11/25/26, 3:34:26 AM UTC"):
 * the CLI prints the same moment as ISO 8601 with the zone, so the two can be told apart. */
export function formatTime(iso) {
  if (!iso) return "";
  return new Date(iso).toLocaleString(undefined, { dateStyle: "short", timeStyle: "long" });
}

/** The short id the pages and download names use. */
export function shortId(id) {
  return id.slice(0, 12);
}

/** The name of an input: the file name it was uploaded with, else a short digest. */
export function inputName(job, field) {
  const input = job.inputs && job.inputs[field];
  if (input) return input.filename || `${input.digest.slice(0, 19)}…`;
  const source = field === "eval.data" ? job.spec.eval && job.spec.eval.data : job.spec[field];
  if (source && typeof source === "object") return source.path || source.uri || "";
  return source ? `${String(source).slice(0, 19)}…` : "";
}

/** The digest behind an input (for a tooltip), or its path or URI. */
export function inputDetail(job, field) {
  const input = job.inputs && job.inputs[field];
  if (input) return input.digest;
  const source = field === "eval.data" ? job.spec.eval && job.spec.eval.data : job.spec[field];
  return source && typeof source === "object" ? source.path || source.uri || "" : `${source || ""}`;
}

/** The spec fields that name the model and data, in the order a reader wants them. */
export function inputFields(job) {
  if (job.spec.models || job.spec.datasets) return Object.keys(job.inputs || {}); // a sweep's uploads, by field
  const fields = ["program", "checkpoint", "data"];
  if (job.spec.eval) fields.push("eval.data");
  return fields.filter((field) => (field === "eval.data" ? job.spec.eval : job.spec[field]));
}

/** "tests.nets:mixed_net" or "program model.pt2". */
export function modelName(job) {
  if (job.spec.models) return `sweep: ${job.spec.models.length} models${job.spec.arch ? ` (${job.spec.arch})` : ""}`;
  if (job.spec.arch) return job.spec.arch;
  return job.spec.program ? `program ${inputName(job, "program")}` : "";
}

/** "2 workers × batch 32, sync". */
export function runShape(spec) {
  const workers = `${spec.workers} worker${spec.workers === 1 ? "" : "s"}`;
  return `${workers} × batch ${spec.batch_size}, ${spec.mode}`;
}

/** Top-1 accuracy before and after, when the job was evaluated on labelled data. */
export function top1(job) {
  const evaluation = job.report && job.report.evaluation;
  if (!evaluation || !evaluation.before || evaluation.before.top1 === undefined) return null;
  return { before: evaluation.before.top1, after: evaluation.after.top1 };
}

/** What a finished job came to, in one line: samples calibrated and accuracy, or why it failed. */
export function resultText(job) {
  if (job.status === "failed") return job.error ? job.error.title : "failed";
  if (job.status === "cancelled") return "cancelled";
  if (job.status !== "succeeded") return "";
  const samples = job.report && job.report.samples;
  const parts = [samples !== undefined ? `${samples} samples calibrated` : "calibrated"];
  const accuracy = top1(job);
  if (accuracy) parts.push(`top-1 ${accuracy.before.toFixed(3)} → ${accuracy.after.toFixed(3)}`);
  return parts.join(" · ");
}

/** What a standard error of the statistics means, said beside it (as the CLI and the HTML
 * report say it: service/run/report/page.py, STANDARD_ERROR_MEANING). */
export const STANDARD_ERROR_MEANING = "about how far more data of the same kind would move them";

/** How precise the statistics are, in the words of the CLI's summary: where max_samples "auto"
 * stopped ("statistics converged at 1,536 of 50,000 samples: every standard error under ±5.0%,
 * ..."), that the data ran out first, or the worst standard error and what it means; "" without
 * a report. */
export function statisticsLine(report) {
  if (!report) return "";
  const worst = report.standard_error_max;
  const percent = (value) => `${(100 * value).toFixed(1)}%`;
  const where = worst ? `worst: ${worst.layer}, ${worst.statistic} \u00b1${percent(worst.error)}` : "no standard errors";
  const convergence = report.convergence;
  if (convergence) {
    const seen = `${convergence.samples.toLocaleString("en-US")} of ${convergence.available_samples.toLocaleString("en-US")} samples`;
    if (convergence.converged) {
      return `statistics converged at ${seen}: every standard error under \u00b1${percent(convergence.tolerance)}, ${STANDARD_ERROR_MEANING} (${where})`;
    }
    return `statistics did not converge to a standard error of \u00b1${percent(convergence.tolerance)} on all ${seen} (${where}): give more data`;
  }
  if (!worst) return "";
  const order = report.order ? `; order ${report.order}${report.order === "shuffled" ? `, seed ${report.seed}` : ""}` : "";
  const samples = (report.samples ?? 0).toLocaleString("en-US");
  return `statistics \u00b1${percent(worst.error)}, the standard error of ${samples} samples: ${STANDARD_ERROR_MEANING} (${where}${order})`;
}
