// The page's entry: the avatar picker from /v1/avatars, then the live and jobs panels.

import { api, clearError, onKeyChange, showError } from "./api.js";
import "./live.js";
import { refresh as refreshJobs } from "./jobs.js";

const avatarSelect = document.getElementById("avatar");

async function load() {
  clearError();
  const avatars = await (await api("/v1/avatars")).json();
  const picked = avatarSelect.value;
  avatarSelect.replaceChildren(...avatars.map((a) => new Option(`${a.name} (${a.width}x${a.height}, ${a.fps} fps)`, a.name)));
  if (avatars.some((a) => a.name === picked)) avatarSelect.value = picked;
  await refreshJobs();
}

onKeyChange(() => load().catch(showError));
load().catch(showError);
