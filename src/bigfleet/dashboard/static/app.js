// BigFleet dashboard: polls /api/fleet and renders it. No framework, no build step.
"use strict";

const POLL_MS = 3000;
const SVG_NS = "http://www.w3.org/2000/svg";

function $(id) { return document.getElementById(id); }

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text === undefined || text === null ? "" : String(text);
  if (cls) td.className = cls;
  return td;
}

function fillTable(id, rows, render) {
  const body = $(id).tBodies[0];
  body.replaceChildren();
  if (!rows || rows.length === 0) {
    const tr = document.createElement("tr");
    const td = cell("none", "empty");
    td.colSpan = $(id).tHead.rows[0].cells.length;
    tr.appendChild(td);
    body.appendChild(tr);
    return;
  }
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const c of render(row)) tr.appendChild(c instanceof Node ? c : cell(c));
    body.appendChild(tr);
  }
}

function kv(map) {
  return Object.keys(map || {}).sort().map((k) => k + "=" + map[k]).join(", ");
}

// Milli-units to a short human figure: cpu in cores, memory in GiB.
function cores(milli) { return milli === undefined ? "0" : (milli / 1000).toFixed(milli % 1000 ? 1 : 0); }
function gib(milli) { return milli === undefined ? "0" : (milli / 1000 / 1073741824).toFixed(1) + "Gi"; }

function ago(seconds) {
  if (seconds < 60) return Math.round(seconds) + "s";
  if (seconds < 3600) return Math.round(seconds / 60) + "m";
  return (seconds / 3600).toFixed(1) + "h";
}

function bar(have, want) {
  const div = document.createElement("div");
  div.className = "bar" + (have < want ? " short" : "");
  const span = document.createElement("span");
  const frac = want > 0 ? Math.min(1, have / want) : (have > 0 ? 1 : 0);
  span.style.width = Math.round(frac * 100) + "%";
  div.appendChild(span);
  const td = document.createElement("td");
  td.appendChild(div);
  return td;
}

function chart(id, history, keys) {
  const svg = $(id);
  svg.replaceChildren();
  const W = 600, H = 160, L = 34, B = 18, T = 8;
  const axis = document.createElementNS(SVG_NS, "path");
  axis.setAttribute("class", "axis");
  axis.setAttribute("d", `M${L},${T} V${H - B} H${W}`);
  svg.appendChild(axis);
  if (!history || history.length === 0) return;
  let max = 1;
  for (const s of history) for (const k of keys) max = Math.max(max, s[k] || 0);
  const t0 = history[0].t, t1 = history[history.length - 1].t;
  const span = Math.max(1, t1 - t0);
  const x = (t) => L + ((t - t0) / span) * (W - L - 4);
  const y = (v) => H - B - (v / max) * (H - B - T);
  keys.forEach((k, i) => {
    const line = document.createElementNS(SVG_NS, "polyline");
    line.setAttribute("class", "s" + i);
    line.setAttribute("points", history.map((s) => `${x(s.t).toFixed(1)},${y(s[k] || 0).toFixed(1)}`).join(" "));
    svg.appendChild(line);
  });
  const label = (text, lx, ly) => {
    const el = document.createElementNS(SVG_NS, "text");
    el.setAttribute("x", lx); el.setAttribute("y", ly); el.textContent = text;
    svg.appendChild(el);
  };
  label(String(max), 2, T + 8);
  label("0", 2, H - B);
  label(ago(span) + " window", W - 80, H - 4);
}

function render(d) {
  $("component").textContent = d.component || "";
  $("node-id").textContent = d.id || "";
  const err = $("error");
  if (d.error) {
    err.hidden = false;
    err.textContent = d.error + (d.leader ? " — the leader's gRPC address is " + d.leader : "");
  } else {
    err.hidden = true;
  }
  const inv = d.inventory || {};
  $("tile-total").textContent = inv.total ?? 0;
  $("tile-bound").textContent = inv.bound ?? 0;
  $("tile-free").textContent = inv.free ?? 0;
  $("tile-shards").textContent = (d.shards || []).length;
  $("tile-clusters").textContent = (d.clusters || []).length;
  $("tile-shortfalls").textContent = (d.shortfalls || []).length;
  let status = "updated " + d.generated_at;
  if (d.component === "shard") {
    status += " · cycle " + d.cycle + (d.paused ? " · PAUSED" : "") + (d.dry_run ? " · DRY-RUN" : "");
  }
  $("status").textContent = status;

  fillTable("shards", d.shards, (s) => [s.shard_id, s.address, cell(s.status, s.status === "up" ? "" : "bad"),
    s.machines, s.free, s.clusters, s.shortfalls, s.last_heartbeat || "—"]);
  const coord = d.component === "coordinator";
  for (const el of document.querySelectorAll("[data-only]")) el.hidden = el.dataset.only !== d.component;
  $("inventory-title").textContent = coord ? "Inventory by instance type (from shard reports)" : "Inventory by state";
  $("inventory-key").textContent = coord ? "instance type" : "state";
  $("actions-title").textContent = coord ? "Recent transfers" : "Recent actions";
  const states = (coord ? inv.by_instance_type : inv.by_state) || {};
  fillTable("inventory-states", Object.keys(states).sort().map((k) => [k, states[k]]), (r) => r);
  fillTable("clusters", d.clusters, (c) => [c.cluster_id, c.shard_id,
    c.bound_machines ?? "", c.needs ?? "", c.unmet ?? "",
    c.handoff ? "handoff → " + c.handoff : (c.bound_at ? "bound " + c.bound_at : (c.session === false ? "no session" : ""))]);
  fillTable("capacity", d.capacity, (c) => [c.cluster_id, cores(c.need.cpu), cores(c.bound.cpu),
    gib(c.need.memory), gib(c.bound.memory), bar(c.bound.cpu || 0, c.need.cpu || 0)]);
  fillTable("shortfalls", d.shortfalls, (s) => [s.shard_id, s.priority, kv(s.deficit), s.requirements || "—",
    s.age_cycles, ago(s.age_seconds)]);
  $("needs-count").textContent = d.component === "shard" ? "(" + d.needs_total + ")" : "";
  fillTable("needs", d.needs, (n) => [n.cluster_id, n.priority, kv(n.resources),
    cell(n.satisfied ? "yes" : "no", n.satisfied ? "" : "bad"), n.claimed, n.unmet_reason, n.age_cycles_unmet]);
  fillTable("actions", d.actions, (a) => [new Date(a.t * 1000).toISOString().replace(/\.\d+Z$/, "Z"), a.cycle || "",
    a.kind, a.machine_id, a.cluster_id, a.detail]);
  chart("chart-machines", d.history, ["total", "bound", "free"]);
  // On a coordinator the second chart is clusters and shortfalls (it has no per-need verdicts).
  const demand = coord ? [["needs", "clusters"], ["shortfalls", "shortfalls"]]
    : [["needs", "needs"], ["unmet", "unmet"], ["shortfalls", "shortfalls"]];
  chart("chart-demand", d.history, demand.map((k) => k[0]));
  const cap = $("cap-demand");
  cap.replaceChildren();
  demand.forEach((k, i) => {
    const key = document.createElement("span");
    key.className = "key k" + i;
    cap.append(key, k[1] + " ");
  });
  document.body.dataset.loaded = String((Number(document.body.dataset.loaded) || 0) + 1);
}

async function poll() {
  try {
    const resp = await fetch("/api/fleet", { cache: "no-store" });
    const data = await resp.json();
    if (!resp.ok) throw new Error(data.error || resp.statusText);
    render(data);
  } catch (e) {
    const err = $("error");
    err.hidden = false;
    err.textContent = "cannot load /api/fleet: " + e.message;
  }
  setTimeout(poll, POLL_MS);
}

poll();
