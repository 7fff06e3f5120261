// What live.js and jobs.js share: the API key, requests that carry it, the one-line error, the
// picked avatar, and `window.lipstream` (a little state for tests and the console).

const keyInput = document.getElementById("key");
const errorLine = document.getElementById("error");
const avatarSelect = document.getElementById("avatar");

export const state = (window.lipstream = { pc: null, session: null, events: [], jobs: [], errors: [] });

keyInput.value = localStorage.getItem("lipstream.key") || "";
keyInput.addEventListener("change", () => localStorage.setItem("lipstream.key", keyInput.value.trim()));
document.getElementById("settings").addEventListener("submit", (event) => event.preventDefault()); // Enter: a change, no reload

const key = () => keyInput.value.trim();
export const avatar = () => avatarSelect.value;

// EventSource, <video src> and WebSocket cannot send an Authorization header: the key goes as ?token=
export function withToken(path) {
  return key() ? `${path}${path.includes("?") ? "&" : "?"}token=${encodeURIComponent(key())}` : path;
}

// fetch() with the key; a response that is not 2xx throws its JSON "detail" as the message
export async function api(path, options = {}) {
  const headers = new Headers(options.headers);
  if (key()) headers.set("Authorization", `Bearer ${key()}`);
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) throw new ApiError(response.status, await detail(response));
  return response;
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function detail(response) {
  try {
    const { detail } = await response.json();
    if (typeof detail === "string") return `${response.status}: ${detail}`;
    if (Array.isArray(detail)) return `${response.status}: ${detail.map((d) => `${d.loc?.at(-1)}: ${d.msg}`).join("; ")}`;
  } catch {
    // not JSON: the status line says enough
  }
  return `${response.status} ${response.statusText}`;
}

export function showError(error) {
  const message = String(error?.message ?? error);
  state.errors.push(message);
  errorLine.textContent = message;
  errorLine.hidden = false;
}

export function clearError() {
  errorLine.hidden = true;
}

export function onKeyChange(callback) {
  keyInput.addEventListener("change", callback);
}
