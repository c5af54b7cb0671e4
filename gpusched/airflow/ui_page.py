# ruff: noqa: E501  (the page is one HTML/CSS/JS document; its lines are not Python)
"""The "GPU fleet" page: one self-contained HTML document (no external assets, works offline).

It draws the fleet as a picture — racks → nodes → link islands → device tiles coloured by state
(allocated / shared / free / faulty / cordoned / standby, degraded outlined; MIG instances and AMD
partitions as segments inside their device's tile) — with the queue
(and why each task waits), the tries recently failed without starting (never fit, with the
reason), active allocations, recent preemptions and moves between GPU types
(``preemption = migrate``, labelled "move": from model/devices -> to), partitions, tenant budgets and
the demand forecast below, refreshed every few seconds. Its ``fetch`` calls go to the sibling JSON routes on the
same origin with the browser's Airflow session cookie (``credentials: "same-origin"``).
"""

from __future__ import annotations

__all__ = ["REFRESH_S", "render_page"]

REFRESH_S = 5
"""Seconds between refreshes of the page's data."""

_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>GPU fleet — gpusched</title>
<style>
:root { --free:#dcfce7; --free-b:#16a34a; --alloc:#2563eb; --shared:#93c5fd; --faulty:#dc2626;
        --cordoned:#6b7280; --standby:#f3f4f6; --ink:#111827; --muted:#6b7280; --line:#e5e7eb; }
* { box-sizing: border-box; }
body { font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--ink);
       margin: 0; padding: 14px 18px; background: #fff; }
h1 { font-size: 18px; margin: 0; } h2 { font-size: 15px; margin: 18px 0 6px; }
header { display: flex; flex-wrap: wrap; gap: 10px; align-items: center; }
.badge { border-radius: 10px; padding: 2px 9px; font-size: 12px; background: #eef2ff; }
.sim { background: #fef3c7; color: #92400e; font-weight: 600; }
.err { background: #fee2e2; color: #991b1b; }
.muted { color: var(--muted); }
.legend { display: flex; gap: 12px; flex-wrap: wrap; margin: 8px 0 4px; }
.legend span { display: inline-flex; align-items: center; gap: 5px; }
.sw { width: 14px; height: 14px; border-radius: 3px; display: inline-block; border: 1px solid #0002; }
.racks { display: flex; flex-wrap: wrap; gap: 14px; align-items: flex-start; }
.rack { border: 2px solid #cbd5e1; border-radius: 8px; padding: 8px; background: #f8fafc; }
.rack > .title { font-weight: 700; margin-bottom: 6px; }
.nodes { display: flex; flex-direction: column; gap: 8px; }
.node { border: 1px solid #cbd5e1; border-radius: 6px; padding: 6px 8px; background: #fff; }
.node.standby { border-style: dashed; opacity: .75; } .node.cordoned { background: #f3f4f6; }
.node .title { display: flex; gap: 6px; align-items: baseline; margin-bottom: 4px; }
.node .title b { font-size: 13px; }
.islands { display: flex; gap: 8px; flex-wrap: wrap; }
.island { border: 1px dotted #94a3b8; border-radius: 5px; padding: 4px; }
.island .lab { font-size: 10px; color: var(--muted); margin-bottom: 2px; }
.devs { display: grid; grid-template-columns: repeat(4, 62px); gap: 4px; }
.dev { height: 52px; border-radius: 4px; padding: 3px 4px; position: relative; overflow: hidden;
       font-size: 10px; line-height: 1.25; border: 1px solid #0003; cursor: default; }
.dev .ix { font-weight: 700; font-size: 11px; } .dev .bar { position: absolute; left: 0; bottom: 0;
       height: 5px; background: #1e3a8a; }
.dev.free { background: var(--free); border-color: var(--free-b); }
.dev.allocated { background: var(--alloc); color: #fff; }
.dev.shared { background: linear-gradient(to top, var(--alloc) var(--fill), var(--shared) var(--fill)); }
.dev.faulty { background: var(--faulty); color: #fff; }
.dev.cordoned { background: repeating-linear-gradient(45deg, #9ca3af 0 6px, #d1d5db 6px 12px); }
.dev.standby { background: var(--standby); border-style: dashed; color: var(--muted); }
.dev.degraded { outline: 3px solid #f59e0b; outline-offset: -3px; }
.dev .slices { position: absolute; left: 2px; right: 2px; bottom: 2px; height: 9px; display: flex; gap: 1px; }
.dev .slices .sl { height: 100%; border-radius: 2px; border: 1px solid #0004; min-width: 3px; }
.sl.free { background: var(--free); } .sl.allocated, .sl.shared { background: #1e3a8a; }
.sl.faulty { background: var(--faulty); } .sl.cordoned, .sl.standby { background: #9ca3af; }
table { border-collapse: collapse; width: 100%; max-width: 1300px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: #f8fafc; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.meter { width: 120px; height: 9px; background: #e5e7eb; border-radius: 5px; overflow: hidden; display: inline-block; }
.meter > i { display: block; height: 100%; background: var(--alloc); }
.meter.over > i { background: #f59e0b; } .meter.full > i { background: var(--faulty); }
.cols { display: grid; grid-template-columns: 1fr 1fr; gap: 18px; max-width: 1300px; }
code { font-size: 12px; }
</style></head>
<body>
<header>
  <h1>GPU fleet</h1>
  <span id="source" class="badge">loading…</span>
  <span id="summary" class="muted"></span>
  <span id="status" class="muted"></span>
</header>
<div class="legend" id="legend"></div>
<div class="racks" id="racks"></div>
<h2>Queue <span class="muted" id="qcount"></span></h2>
<table id="queue"><thead><tr><th>Task</th><th>Request</th><th>Waiting</th><th>Why it waits</th></tr></thead><tbody></tbody></table>
<h2>Failed without starting <span class="muted" id="fcount"></span></h2>
<table id="failed"><thead><tr><th>Task</th><th>When</th><th>Why (not retried)</th></tr></thead><tbody></tbody></table>
<h2>Running allocations <span class="muted" id="acount"></span></h2>
<table id="allocs"><thead><tr><th>Task</th><th>Devices</th><th>Request</th><th>Running</th></tr></thead><tbody></tbody></table>
<h2>Preemptions <span class="muted" id="pcount"></span></h2>
<table id="preempt"><thead><tr><th>Stopped</th><th>For / moved</th><th>Work lost</th><th>When</th><th>Why</th></tr></thead><tbody></tbody></table>
<div class="cols">
 <div><h2>Partitions <span class="muted" id="cap"></span></h2>
 <table id="parts"><thead><tr><th>Partition</th><th>Share</th><th>Used / share (GPUs)</th><th></th><th>GPUs waiting</th></tr></thead><tbody></tbody></table></div>
 <div><h2>Tenant budgets <span class="muted" id="unit"></span></h2>
 <table id="tenants"><thead><tr><th>Tenant</th><th>Used</th><th>Budget</th><th></th><th>Running</th></tr></thead><tbody></tbody></table></div>
</div>
<h2>Demand forecast</h2>
<div id="forecast" class="muted">—</div>
<script>
"use strict";
const REFRESH_MS = __REFRESH_S__ * 1000;
const BASE = location.pathname.replace(/\/ui\/?$/, "/");
const STATES = [["allocated","allocated"],["shared","partially shared"],["free","free"],
                ["faulty","faulty"],["cordoned","cordoned"],["standby","standby"]];
const $ = (id) => document.getElementById(id);
const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c]));
const dur = (s) => s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s/60)} min` : `${(s/3600).toFixed(1)} h`;
const meter = (pct) => { const p = Math.max(0, pct ?? 0);
  return `<span class="meter ${p > 100 ? "full" : p > 85 ? "over" : ""}"><i style="width:${Math.min(100,p)}%"></i></span> ${pct == null ? "" : p.toFixed(0) + "%"}`; };

$("legend").innerHTML = STATES.map(([k, label]) =>
  `<span><i class="sw dev ${k}" style="--fill:50%;height:14px;padding:0"></i>${label}</span>`).join("")
  + `<span><i class="sw" style="outline:3px solid #f59e0b;outline-offset:-3px"></i>degraded</span>`;

async function getJSON(path) {
  const r = await fetch(BASE + path, {credentials: "same-origin", headers: {Accept: "application/json"}});
  if (r.status === 401 || r.status === 403) throw new Error("not signed in to Airflow (reload the Airflow UI)");
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

function shortModel(m) { return m.replace(/^(ascend|instinct)-/i, "").replace(/-(sxm|pcie|oam)\w*/i, "").replace(/-\d+gb$/i, "").toUpperCase(); }

function tile(d) {
  const fill = Math.round(100 * d.used_milli / 1000);
  const who = d.holders.map((h) => `${h.key} (${h.milli / 1000} GPU, ${h.tenant})`).join("\n  ");
  const t = d.telemetry;
  const tip = [`${d.uuid}  #${d.index}  ${d.model} (${d.architecture}, ${d.memory_gib} GiB)`,
    `state: ${d.state}${d.degraded ? " (degraded)" : ""}  health: ${d.health}`,
    `used: ${d.used_milli / 1000} GPU, ${d.used_memory_gib} GiB`,
    who ? `held by:\n  ${who}` : "",
    t ? `util ${t.utilization_pct}%  ${t.temperature_c} °C  ${t.power_w} W` : ""].filter(Boolean).join("\n");
  const line2 = d.slices ? d.partitioned : d.state === "shared" ? `${fill}% used` : d.state === "allocated" ? `${d.used_memory_gib}G` :
                d.state === "free" ? `${d.memory_gib}G free` : d.state;
  return `<div class="dev ${d.state}${d.degraded ? " degraded" : ""}" style="--fill:${fill}%" title="${esc(tip)}">
    <div class="ix">#${d.index}</div><div>${esc(shortModel(d.model))}</div><div>${esc(line2)}</div>
    ${d.slices ? slices(d.slices) : t ? `<div class="bar" style="width:${t.utilization_pct}%"></div>` : ""}</div>`;
}

// MIG instances / AMD partitions inside their device's tile, as wide as their share of its compute.
function slices(list) {
  return `<div class="slices">` + list.map((s) => {
    const who = s.holders.map((h) => `${h.key} (${h.tenant})`).join(", ");
    const tip = `${s.profile} ${s.uuid}  ${s.memory_gib} GiB, ${s.compute_milli / 10}% of the compute: ${s.state}${who ? " — " + who : ""}`;
    return `<i class="sl ${s.state}" style="flex:${s.compute_milli}" title="${esc(tip)}"></i>`;
  }).join("") + `</div>`;
}

function drawFleet(f) {
  const src = $("source");
  src.className = "badge" + (f.simulated ? " sim" : "");
  src.textContent = f.simulated ? `SIMULATED FLEET (${f.source})` : `source: ${f.source}`;
  const s = f.summary, c = s.states;
  $("summary").textContent = `${s.devices} devices on ${s.nodes} nodes · ${s.used_gpus} of ${s.in_service} GPUs in service used (${s.utilisation_pct}%) · `
    + STATES.filter(([k]) => c[k]).map(([k, l]) => `${c[k]} ${l}`).join(" · ");
  if (!f.racks.length) { $("racks").innerHTML = `<p class="muted">No inventory yet: start <code>gpusched agent</code> (or the executor) so the fleet is recorded in the ledger.</p>`; return; }
  $("racks").innerHTML = f.racks.map((r) => `<div class="rack"><div class="title">${esc(r.name)}</div><div class="nodes">` +
    r.nodes.map((n) => `<div class="node${n.standby ? " standby" : ""}${n.cordoned ? " cordoned" : ""}">
      <div class="title"><b>${esc(n.name)}</b>${n.standby ? '<span class="badge">standby</span>' : ""}${n.cordoned ? '<span class="badge err">cordoned</span>' : ""}
      <span class="muted">${esc(Object.entries(n.labels).map(([k, v]) => `${k}=${v}`).join(" "))}</span></div>
      <div class="islands">` + n.islands.map((i) => `<div class="island"><div class="lab">${i.id === "pcie" ? "PCIe only" : esc(i.id.split("/").pop())}</div>
      <div class="devs" style="grid-template-columns:repeat(${Math.min(4, i.devices.length)},62px)">${i.devices.map(tile).join("")}</div></div>`).join("") +
    `</div></div>`).join("") + `</div></div>`).join("");
}

function rows(id, items, render, empty) {
  $(id).querySelector("tbody").innerHTML = items.length ? items.map(render).join("") : `<tr><td colspan="5" class="muted">${empty}</td></tr>`;
}

function drawQueue(q) {
  $("qcount").textContent = `(${q.length} waiting)`;
  rows("queue", q, (e) => `<tr><td>${e.task ? `<a href="${esc(e.task.url)}" title="${esc(e.key)}">${esc(e.task.label)}</a>` : `<code>${esc(e.key)}</code>`}</td><td>${esc(e.summary)}</td><td class="num">${dur(e.waiting_s)}</td><td>${esc(e.reason)}</td></tr>`, "nothing waiting");
}

// Tries the executor failed before they started: can never fit this fleet, invalid request, refused retry.
function drawFailed(f) {
  $("fcount").textContent = `(${f.length} recent)`;
  rows("failed", f, (e) => `<tr><td>${e.task ? `<a href="${esc(e.task.url)}" title="${esc(e.key)}">${esc(e.task.label)}</a>` : `<code>${esc(e.key)}</code>`}</td>
    <td>${esc(new Date(e.at * 1000).toLocaleString())}</td><td>${esc(e.reason)}</td></tr>`, "none");
}

function drawAllocs(a) {
  $("acount").textContent = `(${a.length})`;
  rows("allocs", a, (x) => `<tr><td><code>${esc(x.key)}</code></td><td>${esc(x.shares.map((s) => `${s.node}#${s.index}${s.milli < 1000 ? ` (${s.milli / 1000})` : ""}`).join(", "))}</td>
    <td>${esc(x.summary)}</td><td class="num">${dur(x.running_s)}</td></tr>`, "no active allocation");
}

// Preemptions and (preemption = migrate) moves between GPU types: "move" badge, from -> to.
function drawPreemptions(p) {
  const moves = p.filter((e) => e.kind === "move").length;
  $("pcount").textContent = `(${p.length - moves} preempted, ${moves} moved, recent)`;
  const link = (t, k) => t ? `<a href="${esc(t.url)}" title="${esc(k)}">${esc(t.label)}</a>` : `<code>${esc(k)}</code>`;
  const target = (e) => e.kind === "move" ? `<span class="badge">move</span> ${esc(e.source)} &rarr; ${esc(e.target)}` : link(e.by_task, e.by);
  rows("preempt", p, (e) => `<tr class="${esc(e.kind)}"><td>${link(e.task, e.key)}</td><td>${target(e)}</td><td class="num">${e.lost_gpu_s == null ? "" : dur(e.lost_gpu_s) + " GPU"}</td>
    <td>${esc(new Date(e.at * 1000).toLocaleString())}</td><td>${esc(e.reason)}</td></tr>`, "no preemption or move");
}

const gpus = (x) => String(Math.round(x * 10) / 10);  // MIG slices and fractions: one decimal is enough

function drawQuotas(q) {
  $("cap").textContent = `(${gpus(q.capacity_gpus)} GPUs in service${q.borrowing ? ", borrowing on" : ""})`;
  $("unit").textContent = `(${q.unit}; ${q.enforced ? "enforced: tasks over budget or share wait"
    : "shown only: no quota file, so placement does not apply them"})`;
  rows("parts", q.partitions, (p) => `<tr><td>${esc(p.partition)}</td><td class="num">${p.share_pct}%</td>
    <td class="num">${gpus(p.used_gpus)} / ${gpus(p.share_gpus)}${p.borrowed_gpus ? ` (+${gpus(p.borrowed_gpus)} borrowed)` : ""}</td><td>${meter(p.used_pct_of_share)}</td><td class="num">${p.pending_gpus}</td></tr>`, "—");
  rows("tenants", q.tenants, (t) => `<tr><td>${esc(t.tenant)}</td><td class="num">${t.used_hours} h</td>
    <td class="num">${t.budget_hours == null ? "unlimited" : t.budget_hours + " h"}</td><td>${t.budget_hours == null ? "" : meter(t.used_pct)}</td><td class="num">${t.running_gpus} GPUs</td></tr>`, "no tenant activity this period");
}

function drawForecast(fc) {
  const el = $("forecast");
  if (!fc.available) { el.textContent = fc.note; return; }
  const f = fc.forecast, n = f.mean.length, W = 640, H = 120;
  const hi = Math.max(1, ...f.upper), x = (i) => 30 + i * (W - 40) / Math.max(1, n - 1), y = (v) => H - 15 - (H - 25) * v / hi;
  const band = f.upper.map((v, i) => `${x(i)},${y(v)}`).concat(f.lower.map((v, i) => `${x(n - 1 - i)},${y(f.lower[n - 1 - i])}`)).join(" ");
  const line = f.mean.map((v, i) => `${x(i)},${y(v)}`).join(" ");
  el.className = "";
  el.innerHTML = `<svg width="${W}" height="${H}" role="img" aria-label="forecast"><polygon points="${band}" fill="#bfdbfe"/>
    <polyline points="${line}" fill="none" stroke="#1d4ed8" stroke-width="2"/><text x="0" y="12" font-size="10">${hi.toFixed(0)} GPUs</text>
    <text x="0" y="${H - 4}" font-size="10">0</text><text x="30" y="${H - 2}" font-size="10">${esc(f.timestamps[0].slice(0, 16).replace("T", " "))}</text>
    <text x="${W - 10}" y="${H - 2}" font-size="10" text-anchor="end">${esc(f.timestamps[n - 1].slice(0, 16).replace("T", " "))} UTC</text></svg><div class="muted">model ${esc(f.model)}, ${n} steps of ${f.step_s / 3600} h,
    ${Math.round(f.level * 100)}% interval</div>`;
}

async function refresh() {
  try {
    const [f, q, a, qu, fc, pr, un] = await Promise.all(["fleet", "queue", "allocations", "quotas", "forecast", "preemptions", "unschedulable"].map(getJSON));
    drawFleet(f); drawQueue(q); drawAllocs(a); drawQuotas(qu); drawForecast(fc); drawPreemptions(pr); drawFailed(un);
    $("status").className = "muted"; $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    $("status").className = "badge err"; $("status").textContent = String(e.message || e);
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body></html>
"""


def security_headers(page: str) -> dict[str, str]:
    """Headers for ``page``: a CSP that runs only its own inline script and lets only the same
    origin (the Airflow UI) frame it, plus no MIME sniffing and no referrer."""
    import base64
    import hashlib
    import re

    scripts = re.findall(r"<script>(.*?)</script>", page, flags=re.DOTALL)
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'" for body in scripts
    )
    policy = (
        "default-src 'none'; "
        f"script-src {hashes or chr(39) + 'none' + chr(39)}; "
        # The tiles and meters set style attributes from the script.
        "style-src 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'self'"
    )
    return {
        "Content-Security-Policy": policy,
        "X-Frame-Options": "SAMEORIGIN",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }


def render_page() -> str:
    """The page's HTML (static: all data arrives through the JSON routes)."""
    return _PAGE.replace("__REFRESH_S__", str(REFRESH_S))
