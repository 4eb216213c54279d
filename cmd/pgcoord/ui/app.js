// The page of "pgcoord ui": it renders each state that the CLI sends
// (server-sent events from api/events), and never writes anything.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let lastGood = null; // time of the last state read without error

function el(tag, attrs, ...children) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.setAttribute("class", v);
    else if (k.startsWith("data-")) e.setAttribute(k, String(v));
    else e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function duration(ms) {
  if (ms < 0) ms = 0;
  if (ms < 1000) return Math.round(ms) + "ms";
  const s = ms / 1000;
  if (s < 60) return s.toFixed(1) + "s";
  const m = Math.floor(s / 60), h = Math.floor(m / 60);
  if (h > 0) return h + "h" + (m % 60) + "m";
  return m + "m" + Math.floor(s % 60) + "s";
}

function since(t, now) {
  return t ? duration(now - Date.parse(t)) : "–";
}

function label(l) { return l.name || l.key; }

function fill(tbody, rows, cols, empty) {
  tbody.replaceChildren(...(rows.length ? rows : [el("tr", { class: "empty" }, el("td", { colspan: cols }, empty))]));
}

function renderLocks(st, now) {
  const rows = st.locks.map(l => el("tr", {
      class: l.granted ? "held" : "waiting", "data-key": l.key, "data-name": l.name || "",
      "data-pid": l.pid, "data-granted": l.granted },
    el("td", {}, label(l), l.name ? el("span", { class: "key" }, l.key) : null),
    el("td", {}, l.mode),
    el("td", {}, l.granted ? "held" : "waiting"),
    el("td", { class: "num" }, l.pid),
    el("td", {}, l.application_name || "–"),
    el("td", {}, l.client_addr || "–"),
    el("td", {}, (l.granted && l.since ? "≤" : "") + since(l.since, now)),
    el("td", { class: "num" }, l.fence || "–"),
    el("td", {}, (l.blocked_by || []).map(p => "pid " + p).join(", ") || "–")));
  fill(document.querySelector("#locks tbody"), rows, 9, "no advisory locks in this database");
}

function renderElections(st, now) {
  const rows = st.elections.map(e => el("tr", { "data-election": e.name, "data-leading": e.leading },
    el("td", {}, e.name),
    el("td", {}, e.leading ? e.identity : "none (" + e.identity + " ended)"),
    el("td", { class: "num" }, e.term),
    el("td", {}, e.leading ? since(e.since, now) : "–"),
    el("td", { class: "num" }, e.leading ? e.pid : "–"),
    el("td", {}, e.candidates.map(c => "pid " + c.pid + (c.application_name ? " (" + c.application_name + ")" : "")).join(", ") || "–")));
  fill(document.querySelector("#elections tbody"), rows, 6,
    st.migrated ? "no elections in schema " + st.schema : "schema " + st.schema + " has no pgcoord tables");
}

function renderSemaphores(st, now) {
  const rows = st.semaphores.map(s => el("tr", { "data-semaphore": s.name, "data-held": s.held, "data-queued": s.queued },
    el("td", {}, s.name),
    el("td", {}, el("span", { class: "bar" }, el("span", { style: null })), s.held + " of " + s.limit),
    el("td", {}, s.holders.map(h => "slot " + h.slot + ": " + (h.identity || "?") + " (pid " + h.pid + ", " + since(h.since, now) + ")").join("; ") || "–"),
    el("td", {}, s.queue.map(q => "pid " + q.pid + (q.head ? " (next)" : "")).join(", ") || "–")));
  // The bar's width is set through the DOM: the page's policy allows no inline style attribute.
  rows.forEach((r, i) => {
    const s = st.semaphores[i];
    r.querySelector(".bar span").style.width = Math.min(100, 100 * s.held / s.limit) + "%";
  });
  fill(document.querySelector("#semaphores tbody"), rows, 4,
    st.migrated ? "no semaphores in schema " + st.schema : "schema " + st.schema + " has no pgcoord tables");
}

// renderGraph draws the wait-for graph: backends that wait for nobody on
// the left, each waiter one column right of the furthest backend it waits
// for, an arrow from each waiter to each backend it waits for, labelled
// with the lock it waits for; arrows within a cycle are red and dashed.
function renderGraph(st) {
  const svg = document.getElementById("graph");
  const edges = st.waits;
  const pids = [...new Set(edges.flatMap(e => [e.waiter, e.blocker]))].sort((a, b) => a - b);
  const svgKids = [el("svg:defs", {}, el("svg:marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5,
    markerWidth: 8, markerHeight: 8, orient: "auto-start-reverse" }, el("svg:path", { d: "M 0 0 L 10 5 L 0 10 z" })))];
  if (pids.length === 0) {
    svg.setAttribute("width", 400); svg.setAttribute("height", 40);
    svg.replaceChildren(...svgKids, el("svg:text", { class: "none", x: 12, y: 24 }, "no backend waits for another"));
    return;
  }
  const app = {}, awaits = {};
  for (const l of st.locks) {
    app[l.pid] = l.application_name;
    if (!l.granted && !awaits[l.pid]) awaits[l.pid] = label(l);
  }
  const blockers = {};
  for (const e of edges) (blockers[e.waiter] ||= []).push(e.blocker);
  const depth = {};
  for (const p of pids) depth[p] = 0;
  for (let i = 0; i < pids.length; i++) { // longest chain, bounded for cycles
    for (const e of edges) depth[e.waiter] = Math.min(pids.length, Math.max(depth[e.waiter], depth[e.blocker] + 1));
  }
  const reaches = (from, to) => { // does from wait, directly or not, for to?
    const seen = new Set([from]), todo = [from];
    while (todo.length) {
      const p = todo.pop();
      for (const b of blockers[p] || []) {
        if (b === to) return true;
        if (!seen.has(b)) { seen.add(b); todo.push(b); }
      }
    }
    return false;
  };
  const W = 170, H = 44, GX = 160, GY = 26, M = 12;
  // Rows: depth first from each backend that waits for nobody, so that a
  // waiter sits level with, or below, the backend it waits for.
  const waiters = {};
  for (const e of edges) (waiters[e.blocker] ||= []).push(e.waiter);
  const row = {}, next = {};
  const place = (p, min) => {
    if (p in row) return;
    const c = depth[p];
    row[p] = Math.max(min, next[c] || 0);
    next[c] = row[p] + 1;
    for (const w of (waiters[p] || []).sort((a, b) => a - b)) place(w, row[p]);
  };
  for (const p of pids) if (!blockers[p]) place(p, 0);
  for (const p of pids) place(p, 0); // cycles that no such backend reaches
  const pos = {};
  for (const p of pids) pos[p] = { x: M + depth[p] * (W + GX), y: M + row[p] * (H + GY) };
  const ncol = Math.max(...pids.map(p => depth[p])) + 1;
  const nrow = Math.max(...pids.map(p => row[p])) + 1;
  svg.setAttribute("width", 2 * M + ncol * W + (ncol - 1) * GX);
  svg.setAttribute("height", 2 * M + nrow * H + (nrow - 1) * GY);
  const kids = [...svgKids];
  for (const e of edges) {
    const a = pos[e.waiter], b = pos[e.blocker];
    const cycle = reaches(e.blocker, e.waiter);
    const x1 = a.x, y1 = a.y + H / 2, x2 = b.x + W, y2 = b.y + H / 2;
    kids.push(el("svg:g", { class: "edge" + (cycle ? " cycle" : ""), "data-waiter": e.waiter, "data-blocker": e.blocker },
      el("svg:title", {}, "pid " + e.waiter + " waits for " + (awaits[e.waiter] || "a lock") + ", held by or queued behind pid " + e.blocker),
      el("svg:line", { x1, y1, x2, y2, "marker-end": "url(#arrow)" }),
      el("svg:text", { x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 5, "text-anchor": "middle" }, awaits[e.waiter] || "")));
  }
  for (const p of pids) {
    const { x, y } = pos[p];
    kids.push(el("svg:g", { class: "node" + (blockers[p] ? "" : " root"), "data-pid": p },
      el("svg:rect", { x, y, width: W, height: H, rx: 6 }),
      el("svg:text", { x: x + 8, y: y + 17 }, "pid " + p),
      el("svg:text", { x: x + 8, y: y + 34 }, (app[p] || "").slice(0, 24))));
  }
  svg.replaceChildren(...kids);
}

function render(msg) {
  const now = Date.parse(msg.time);
  const banner = document.getElementById("banner");
  const status = document.getElementById("status");
  if (msg.error) {
    banner.hidden = false;
    banner.textContent = "The database cannot be reached: " + msg.error + ". Retrying every " +
      duration(msg.interval_ms) + (lastGood ? "; showing the state as of " + new Date(lastGood).toLocaleTimeString() : "") + ".";
    document.body.classList.add("stale");
    status.className = "status down";
    status.textContent = "database unreachable since " + new Date(Date.parse(msg.error_since)).toLocaleTimeString();
  } else {
    lastGood = now;
    banner.hidden = true;
    document.body.classList.remove("stale");
    status.className = "status live";
    status.textContent = "schema " + msg.schema + " · updated " + new Date(now).toLocaleTimeString();
  }
  renderGraph(msg);
  renderLocks(msg, now);
  renderElections(msg, now);
  renderSemaphores(msg, now);
  document.body.dataset.polls = msg.polls;
}

function connect() {
  const es = new EventSource("api/events");
  es.onmessage = ev => render(JSON.parse(ev.data));
  es.onerror = () => {
    const banner = document.getElementById("banner");
    banner.hidden = false;
    banner.textContent = "Lost the connection to pgcoord ui; reconnecting…";
    document.body.classList.add("stale");
    document.getElementById("status").className = "status down";
  };
}

connect();
