// Jobs: a render job from the form, the job list with a progress bar each (live over server-sent
// events), and a done job's MP4 played in the page.

import { api, avatar, clearError, showError, state, withToken } from "./api.js";

const form = document.getElementById("job-form");
const list = document.getElementById("job-list");
const player = document.getElementById("result");

const TERMINAL = ["done", "failed", "cancelled"];
const FOLLOW_MAX = 3; // an EventSource holds a connection; a browser opens 6 a server over HTTP/1.1
const rows = new Map(); // job id -> its table row's parts
const followed = new Map(); // job id -> its EventSource

form.addEventListener("submit", (event) => {
  event.preventDefault();
  submit().catch(showError);
});
document.getElementById("refresh").addEventListener("click", () => refresh().catch(showError));

async function submit() {
  clearError();
  const body = new FormData(form);
  body.set("avatar", avatar());
  const job = await (await api("/v1/jobs/render", { method: "POST", body })).json();
  state.jobs.push(job.id);
  form.reset();
  show(job, true);
  follow();
}

// The list as the server has it now (for this key: it may have changed), newest first
export async function refresh() {
  const jobs = await (await api("/v1/jobs?limit=20")).json();
  followed.forEach((source) => source.close());
  followed.clear();
  rows.clear();
  list.replaceChildren(...jobs.map((job) => show(job).tr));
  follow();
}

// Follow the oldest unfinished jobs (the runner takes them in order); each one that ends lets the next in.
function follow() {
  const waiting = [...rows.entries()].filter(([id, row]) => !TERMINAL.includes(row.status) && !followed.has(id));
  waiting.sort(([, a], [, b]) => a.created - b.created);
  for (const [id] of waiting.slice(0, Math.max(0, FOLLOW_MAX - followed.size))) {
    const source = new EventSource(withToken(`/v1/jobs/${id}/events`));
    followed.set(id, source);
    const end = () => {
      source.close();
      followed.delete(id);
    };
    source.addEventListener("job", (message) => {
      const job = JSON.parse(message.data);
      show(job);
      if (TERMINAL.includes(job.status)) {
        end();
        follow();
      }
    });
    source.addEventListener("error", end); // no reconnecting: Refresh picks the job up again
  }
}

function show(job, first = false) {
  let row = rows.get(job.id);
  if (!row) {
    row = { tr: document.createElement("tr") };
    row.tr.dataset.job = job.id;
    row.created = job.created_at;
    row.tr.innerHTML = "<td></td><td></td><td><progress max='1' value='0'></progress></td><td></td><td></td>";
    [row.name, row.avatar, , row.state, row.action] = row.tr.children;
    row.bar = row.tr.querySelector("progress");
    row.name.textContent = job.id.slice(0, 8);
    row.name.title = job.id;
    row.avatar.textContent = job.avatar ?? job.kind;
    rows.set(job.id, row);
    if (first) list.prepend(row.tr);
  }
  row.status = job.status;
  row.bar.value = job.status === "done" ? 1 : job.progress;
  row.state.textContent = job.status === "running" ? `running ${Math.round(100 * job.progress)}%`
    : job.error ? `${job.status}: ${job.error}` : job.status;
  row.state.className = job.status;
  if (job.status === "done" && job.kind !== "compile" && !row.action.firstChild) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = "Play";
    button.addEventListener("click", () => play(job));
    row.action.append(button);
  }
  return row;
}

function play(job) {
  player.src = withToken(job.result); // <video> cannot send the key as a header
  player.hidden = false;
  player.play().catch(() => {}); // a browser that blocks autoplay still shows its controls
}
