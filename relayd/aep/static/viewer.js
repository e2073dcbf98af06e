// relayd's live AEP event viewer (docs/aep.md, "The event viewer"): reads GET /stream of the relay
// that served it, with the token its user typed in. No framework, no build step, no other origin.
// Every value from an event reaches the page as text (textContent), never as markup.
"use strict";

const TOKEN_KEY = "relayd.aep.token";
const MAX_ROWS = 1000; // rows kept on the page; older ones leave it (the relay still holds them)
const RETRY_MS = [1000, 2000, 5000, 10000, 30000];
const MAX_FROM_QUERY = 12000; // bytes of `from` in the query: the request head stays under 16 KiB

const $ = (id) => document.getElementById(id);

const view = {
  token: sessionStorage.getItem(TOKEN_KEY),
  filter: {},
  history: false, // a fresh view starts with from=all (Replay history), else live only
  paused: false,
  generation: 0, // the current stream's; a stream of an older one is ignored
  controller: null,
  retries: 0,
  retryTimer: null,
  positions: new Map(), // session -> {epoch, seq}: the last event shown, as digit strings
  exhausted: new Set(), // sessions whose gap a replay-exhausted marker counted already
  sessions: new Map(), // session -> its row in the session list
  shown: 0,
  gaps: 0,
};

function setState(state, text) {
  document.body.dataset.state = state;
  $("status").textContent = text;
}

// The stream ------------------------------------------------------------------------------------

function streamUrl(from) {
  const query = new URLSearchParams();
  if (Object.keys(view.filter).length) query.set("filter", JSON.stringify(view.filter));
  if (from) query.set("from", from);
  if (view.token !== null && !headerSafe(view.token)) query.set("access_token", view.token);
  const q = query.toString();
  return "stream" + (q ? "?" + q : "");
}

// A header value must be Latin-1; a token that is not printable ASCII goes in the query instead,
// where it is sent as UTF-8 (the relay reads both).
function headerSafe(token) {
  return /^[\x20-\x7e]*$/.test(token);
}

// Where a resumed stream starts: after the last event shown of each session, as the relay's `from`
// (positions are exact integers of any size, so they are written as the digits they came as).
// The relay answers a request head over 16 KiB with 431, so the sessions shown least recently that
// do not fit are not resumed: each is counted as a gap, and shown afresh from its next live event.
function resumeFrom() {
  const entries = [];
  const left = [];
  let size = 0;
  for (const [session, at] of [...view.positions].reverse()) { // the most recently shown first
    const entry = '{"session":' + JSON.stringify(session) + ',"epoch":' + at.epoch + ',"seq":' + at.seq + "}";
    const cost = encodeURIComponent(entry).length + 3; // and its comma, encoded
    if (size + cost > MAX_FROM_QUERY) {
      left.push(session);
    } else {
      size += cost;
      entries.unshift(entry);
    }
  }
  if (left.length) {
    for (const session of left) {
      view.positions.delete(session);
      countGap();
    }
    addRow(marker("gap: the " + left.length + " sessions shown least recently are not resumed (too many for " +
                  "one request): their events since the stream stopped are not shown; Replay history shows them"));
  }
  return entries.length ? "[" + entries.join(",") + "]" : null;
}

// Where the stream (re)starts: after what was shown, or for a view that has shown nothing yet, its
// beginning (history or live).
function resumePoint() {
  return view.positions.size ? resumeFrom() : view.history ? "all" : null;
}

function connect(from) {
  stop();
  const generation = ++view.generation;
  const controller = (view.controller = new AbortController());
  const headers = { accept: "text/event-stream" };
  if (view.token !== null && headerSafe(view.token)) headers.authorization = "Bearer " + view.token;
  setState("connecting", "connecting…");
  fetch(streamUrl(from), { headers, signal: controller.signal, cache: "no-store" })
    .then((response) => opened(response, generation))
    .catch((error) => {
      if (generation === view.generation && !controller.signal.aborted) retry("connection failed: " + error.message);
    });
}

function stop() {
  view.generation++;
  clearTimeout(view.retryTimer);
  if (view.controller) view.controller.abort();
  view.controller = null;
}

async function opened(response, generation) {
  if (generation !== view.generation) return;
  if (response.status === 401) {
    const refused = view.token !== null;
    forgetToken();
    askToken(refused ? "The relay refused that token: enter the relay's token." : "This relay needs a token.");
    return;
  }
  if (response.status !== 200) {
    const body = (await response.text()).slice(0, 500);
    if (generation !== view.generation) return;
    if (response.status === 400 || response.status === 403) {
      setState("refused", "refused (" + response.status + "): " + body); // a bad filter: fix it, then Apply
    } else {
      retry("relay answered " + response.status + " " + body);
    }
    return;
  }
  view.retries = 0;
  $("token-form").hidden = true;
  $("forget").hidden = view.token === null;
  setState("live", "live");
  await read(response.body, generation);
}

function retry(why) {
  const delay = RETRY_MS[Math.min(view.retries++, RETRY_MS.length - 1)];
  setState("reconnecting", "reconnecting in " + delay / 1000 + " s (" + why + ")");
  view.retryTimer = setTimeout(() => connect(resumePoint()), delay);
}

// An SSE parser over fetch: unlike EventSource it sees the relay's comments (replay-exhausted) and
// events of every type, and sends the token in a header.
async function read(body, generation) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let rest = "";
  let frame = { event: "", data: [], id: null };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (generation !== view.generation) return;
      if (done) break;
      const lines = (rest + value).split("\n");
      rest = lines.pop();
      for (let line of lines) {
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (frame.data.length) received(frame.event || "message", frame.data.join("\n"), frame.id);
          frame = { event: "", data: [], id: null };
        } else if (line.startsWith(":")) {
          comment(line.slice(1).trim());
        } else {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value.startsWith(" ")) value = value.slice(1);
          if (field === "event") frame.event = value;
          else if (field === "data") frame.data.push(value);
          else if (field === "id") frame.id = value;
        }
      }
    }
  } catch (error) {
    if (generation !== view.generation) return;
    retry("stream broken: " + error.message);
    return;
  }
  retry("stream ended"); // cut off, or the relay is shutting down: resume where it stopped
}

function comment(line) {
  const exhausted = /^replay-exhausted (.+) ([0-9]+):([0-9]+)$/.exec(line);
  if (exhausted) {
    countGap();
    view.exhausted.add(exhausted[1]);
    addRow(marker("gap: the relay no longer holds every event of session " + exhausted[1] +
                  " after the position asked for; its earliest is " + exhausted[2] + ":" + exhausted[3]));
  } else if (line === "shutting-down") {
    setState("reconnecting", "the relay is shutting down");
  }
}

// Events ----------------------------------------------------------------------------------------

function received(type, data, id) {
  let event = null;
  try {
    event = JSON.parse(data);
  } catch (error) {
    event = null;
  }
  const fields = event !== null && typeof event === "object" ? event : {};
  // A sequenced event's position is its id line, `session:epoch:seq` (the session may hold ":").
  const position = id === null ? null : /^(.+):([0-9]+):([0-9]+)$/.exec(id);
  const session = position ? position[1] : typeof fields.session === "string" ? fields.session : "";
  if (position) track(session, position[2], position[3]);
  if (session) sawSession(session, text(fields.agent));
  addRow(eventRow(type, session, position, fields, data));
}

function track(session, epoch, seq) {
  const last = view.positions.get(session);
  const keys = Object.keys(view.filter);
  const wholeSessions = keys.every((key) => key === "session"); // no filter hides part of a session
  const counted = view.exhausted.delete(session);
  if (last && wholeSessions && !counted && last.epoch === epoch && BigInt(seq) > BigInt(last.seq) + 1n) countGap();
  if (!last || BigInt(epoch) > BigInt(last.epoch) || (epoch === last.epoch && BigInt(seq) > BigInt(last.seq))) {
    view.positions.delete(session); // (re)inserted last: the map's order is the order last shown
    view.positions.set(session, { epoch, seq });
  }
}

function countGap() {
  view.gaps++;
  $("gaps").textContent = String(view.gaps);
}

function text(value) {
  if (value === undefined || value === null) return "";
  return typeof value === "string" ? value : JSON.stringify(value);
}

function span(className, value) {
  const element = document.createElement("span");
  element.className = className;
  element.textContent = value;
  element.title = value;
  return element;
}

function eventRow(type, session, position, fields, data) {
  const row = document.createElement("li");
  row.className = "event";
  if (position) row.dataset.position = position[0];
  const summary = document.createElement("div");
  summary.className = "summary";
  const at = position ? (position[2] === "0" ? position[3] : position[2] + ":" + position[3]) : "–";
  summary.append(
    span("time", text(fields.time)),
    span("type", type),
    span("session", session),
    span("seq", at),
    span("agent", text(fields.agent)),
  );
  const payload = document.createElement("pre");
  payload.className = "payload";
  payload.hidden = true;
  summary.addEventListener("click", () => {
    if (!payload.textContent) payload.textContent = pretty(data);
    payload.hidden = !payload.hidden;
  });
  row.append(summary, payload);
  return row;
}

function pretty(data) {
  try {
    return JSON.stringify(JSON.parse(data), null, 2);
  } catch (error) {
    return data;
  }
}

function marker(message) {
  const row = document.createElement("li");
  row.className = "marker";
  row.textContent = message;
  return row;
}

function addRow(row) {
  const list = $("events");
  list.prepend(row); // newest at the top
  while (list.childElementCount > MAX_ROWS) list.lastElementChild.remove();
  if (row.className === "event") {
    view.shown++;
    $("shown").textContent = String(view.shown);
  }
}

function sawSession(session, agent) {
  const known = view.sessions.get(session);
  if (known) {
    known.count.textContent = String(Number(known.count.textContent) + 1);
    return;
  }
  const row = document.createElement("li");
  row.title = "show only this session";
  const count = span("count", "1");
  row.append(span("name", session), count);
  if (agent) row.append(span("agent", agent));
  row.addEventListener("click", () => {
    $("filter-session").value = session;
    applyFilter();
  });
  view.sessions.set(session, { row, count });
  $("sessions").prepend(row);
}

// Controls --------------------------------------------------------------------------------------

// One input of the filter form: "" is any, "a, b" any of them (the relay's own attr-match grammar).
function wanted(input) {
  const values = input.value.split(",").map((v) => v.trim()).filter((v) => v);
  return values.length === 0 ? undefined : values.length === 1 ? values[0] : values;
}

function readFilter() {
  const filter = {};
  for (const key of ["session", "agent", "type"]) {
    const value = wanted($("filter-" + key));
    if (value !== undefined) filter[key] = value;
  }
  return filter;
}

// A fresh view: nothing shown, no position, counters at zero; then a stream from history or live.
function restart() {
  $("events").replaceChildren();
  view.positions.clear();
  view.exhausted.clear();
  view.shown = 0;
  view.gaps = 0;
  $("shown").textContent = "0";
  $("gaps").textContent = "0";
  view.paused = false;
  $("pause").textContent = "Pause";
  if (view.token === null && document.body.dataset.state === "token") return; // it waits for a token
  connect(resumePoint());
}

function applyFilter() {
  view.filter = readFilter();
  $("filter-json").textContent = JSON.stringify(view.filter);
  restart();
}

function togglePause() {
  if (view.paused) {
    view.paused = false;
    $("pause").textContent = "Pause";
    connect(resumePoint()); // after the last event shown of each session: nothing lost, none twice
  } else {
    stop();
    view.paused = true;
    $("pause").textContent = "Resume";
    setState("paused", "paused");
  }
}

function askToken(reason) {
  stop();
  view.paused = false;
  $("pause").textContent = "Pause";
  $("token-reason").textContent = reason;
  $("token-form").hidden = false;
  $("forget").hidden = true;
  setState("token", "token needed");
  $("token").focus();
}

function forgetToken() {
  view.token = null;
  sessionStorage.removeItem(TOKEN_KEY);
}

$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  view.token = $("token").value;
  $("token").value = "";
  sessionStorage.setItem(TOKEN_KEY, view.token);
  $("token-form").hidden = true;
  connect(resumePoint());
});
$("filter-form").addEventListener("submit", (e) => {
  e.preventDefault();
  applyFilter();
});
$("pause").addEventListener("click", togglePause);
$("replay").addEventListener("click", () => {
  view.history = true;
  restart();
});
$("clear").addEventListener("click", () => {
  $("events").replaceChildren();
  view.shown = 0;
  $("shown").textContent = "0";
});
$("forget").addEventListener("click", () => {
  forgetToken();
  askToken("Token forgotten: enter one to read the stream again.");
});

connect(null);
