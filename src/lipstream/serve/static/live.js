// Live: a WebRTC session with the presenter (POST the offer, DELETE the Location to end) and its
// speech WebSocket: a file spoken over it in PCM16 chunks, interrupts, and the speech events it reports.

import { api, avatar, clearError, showError, state, withToken } from "./api.js";
import { pcm16, RATE } from "./pcm.js";

const startButton = document.getElementById("start");
const micBox = document.getElementById("mic");
const video = document.getElementById("remote");
const fileInput = document.getElementById("speech-file");
const interruptButton = document.getElementById("interrupt");
const log = document.getElementById("speech-log");

const CHUNK = RATE / 10; // 100 ms a message
const LEAD_MS = 300; // sent this far ahead of real time: the server buffers, a late chunk would be a gap
const ICE_WAIT_MS = 3000;

let pc = null; // the RTCPeerConnection, while a session is open
let sessionUrl = null; // its Location
let socket = null; // the speech WebSocket
let socketOpen = null; // resolves when it is open
let mic = null; // the microphone's MediaStream, when it is the speech
let speaking = null; // the file being sent: { cancelled }

startButton.addEventListener("click", () => (pc ? stop() : start()).catch(showError));
interruptButton.addEventListener("click", interrupt);
fileInput.addEventListener("change", () => {
  const file = fileInput.files[0];
  fileInput.value = ""; // the same file can be picked again
  if (file) speak(file).catch(showError);
});

async function start() {
  clearError();
  startButton.disabled = true;
  try {
    pc = state.pc = new RTCPeerConnection();
    if (micBox.checked) {
      mic = await navigator.mediaDevices.getUserMedia({ audio: true });
      pc.addTrack(mic.getAudioTracks()[0], mic); // sendrecv: the server lip-syncs what it hears
    } else {
      pc.addTransceiver("audio", { direction: "recvonly" });
    }
    pc.addTransceiver("video", { direction: "recvonly" });
    const remote = new MediaStream();
    pc.addEventListener("track", (event) => {
      remote.addTrack(event.track);
      video.srcObject = remote; // set again: the element takes up the track it did not have
    });
    pc.addEventListener("connectionstatechange", () => {
      if (pc?.connectionState === "failed") stop().catch(() => {}).then(() => showError("the live connection failed"));
    });
    await pc.setLocalDescription(await pc.createOffer());
    await iceGathered(pc); // the server takes no trickled candidates: the offer must carry them
    const response = await api(`/v1/sessions?avatar=${encodeURIComponent(avatar())}`, {
      method: "POST",
      headers: { "Content-Type": "application/sdp" },
      body: pc.localDescription.sdp,
    });
    sessionUrl = response.headers.get("Location");
    state.session = response.headers.get("X-Session-Id");
    await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
    openSocket(state.session);
    startButton.textContent = "Stop";
    interruptButton.disabled = false;
  } catch (error) {
    await stop().catch(() => {}); // the error that stopped the start is the one to show
    throw error;
  } finally {
    startButton.disabled = false;
  }
}

async function stop() {
  if (speaking) speaking.cancelled = true;
  const url = sessionUrl;
  sessionUrl = state.session = null;
  try {
    // DELETE first: a peer connection closed first ends the session from the server's side (a 404 here)
    if (url) {
      await api(url, { method: "DELETE" }).catch((error) => {
        if (error.status !== 404) throw error;
      });
    }
  } finally {
    socket?.close();
    socket = socketOpen = null;
    pc?.close();
    pc = state.pc = null;
    mic?.getTracks().forEach((track) => track.stop());
    mic = null;
    video.srcObject = null;
    startButton.textContent = "Start";
    interruptButton.disabled = true;
  }
}

function iceGathered(pc) {
  return new Promise((resolve) => {
    if (pc.iceGatheringState === "complete") return resolve();
    pc.addEventListener("icegatheringstatechange", () => pc.iceGatheringState === "complete" && resolve());
    setTimeout(resolve, ICE_WAIT_MS); // a slow interface: offer what was gathered (host candidates come first)
  });
}

function openSocket(id) {
  const url = new URL(withToken(`/v1/sessions/${id}/speech`), window.location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  const ws = (socket = new WebSocket(url));
  socketOpen = new Promise((resolve, reject) => {
    ws.addEventListener("open", resolve);
    ws.addEventListener("close", () => reject(new Error("the speech socket closed")));
  });
  socketOpen.catch(() => {}); // awaited by speak(); not an error when nothing is spoken
  let refusal = null; // the error message the server sends before it closes the socket
  const mine = sessionUrl; // Stop sets it to null first: the close that follows is no error
  ws.addEventListener("message", (message) => {
    const event = JSON.parse(message.data);
    if (event.type === "error") refusal = event.message;
    note(event);
  });
  ws.addEventListener("close", (event) => {
    // 4401 the key, 4404 no such session, 4410 it ended; 1003, 1007, 1009 a message the server refused
    if (sessionUrl !== mine) return;
    if (event.code >= 4000 || [1003, 1007, 1009].includes(event.code)) {
      showError(`the speech socket was closed (${event.code}): ${refusal || event.reason || "no reason given"}`);
    }
  });
}

function note(event) {
  state.events.push(event);
  const line = document.createElement("li");
  line.textContent = event.type === "speech"
    ? `${new Date().toLocaleTimeString()} utterance ${event.utterance} ${event.kind} (at ${event.position_s} s)`
    : `${event.type}: ${event.message}`;
  log.prepend(line);
}

async function speak(file) {
  clearError();
  if (!socket) throw new Error("start a live session first, then speak a file");
  const pcm = await pcm16(await file.arrayBuffer());
  await socketOpen;
  if (speaking) interrupt(); // picked while another is still being sent: that one is cut off
  const run = (speaking = { cancelled: false });
  const ws = socket;
  ws.send(JSON.stringify({ type: "start", rate: RATE }));
  const t0 = performance.now();
  for (let i = 0; i < pcm.length; i += CHUNK) {
    const wait = t0 + (1000 * i) / RATE - LEAD_MS - performance.now();
    if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
    if (run.cancelled || ws.readyState !== WebSocket.OPEN) return;
    ws.send(pcm.subarray(i, i + CHUNK)); // the view's bytes: little-endian int16 on every browser's platform
  }
  ws.send(JSON.stringify({ type: "end" }));
  if (speaking === run) speaking = null;
}

function interrupt() {
  if (speaking) speaking.cancelled = true;
  speaking = null;
  if (socket?.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "interrupt" }));
}
