"""report.html: one self-contained page (inline CSS, JS and SVG; no request leaves the file)
rendering report.json's data: sortable tables and bar charts of time and memory per node."""
from __future__ import annotations

import html
import json
from string import Template
from typing import Any, Mapping

_PAGE = Template(r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>$title</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;background:#f5f6f8}
header{background:#1d2330;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#b8c0d0;font-size:13px}
main{padding:16px 24px;max-width:1200px}
section{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.08);padding:12px 16px;margin:0 0 16px}
h2{font-size:16px;margin:4px 0 10px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.08);padding:10px 14px;min-width:150px}
.card b{display:block;font-size:18px}.card span{color:#5b6475;font-size:12px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:4px 8px;border-bottom:1px solid #e6e8ec;text-align:left;white-space:nowrap}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
th{cursor:pointer;user-select:none;background:#f0f2f5;position:sticky;top:0}
th:hover{background:#e2e6ec}th.asc::after{content:" \25B2"}th.desc::after{content:" \25BC"}
.scroll{max-height:420px;overflow:auto}
.bar{fill:#3b6fd8}.bar.bwd{fill:#e08a2c}.bar.mem{fill:#2a9d6f}
svg text{font-size:11px;fill:#1d2330}.muted{color:#5b6475;font-size:12px}
</style></head>
<body>
<header><h1>$title</h1><p>$subtitle</p></header>
<main>
<div class="cards" id="cards"></div>
<section><h2>Time per node (top 20, &micro;s per run; forward blue, backward orange)</h2><div id="time-chart"></div></section>
<section><h2>Nodes</h2><p class="muted" id="node-note"></p><div class="scroll"><table id="nodes"></table></div></section>
<section><h2>Time per op type</h2><div class="scroll"><table id="optypes"></table></div></section>
<section><h2>Fusions spanning several nodes</h2><div class="scroll"><table id="fusions"></table></div></section>
<section><h2>Memory live at the peak, by node (bytes)</h2><div id="mem-chart"></div>
<div class="scroll"><table id="buffers"></table></div></section>
<section><h2>Compile phases and runs</h2><table id="phases"></table><div id="runs-chart"></div></section>
</main>
<script type="application/json" id="report-data">$data</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("report-data").textContent);
const T = D.time || {}, M = D.memory || {}, P = D.program || {};
const fmtB = b => { const u = ["B","KiB","MiB","GiB","TiB"]; let i = 0; b = +b || 0;
  while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; } return (i ? b.toFixed(1) : b) + " " + u[i]; };
const fmt = (v, d) => (+v).toLocaleString("en-US", {maximumFractionDigits: d === undefined ? 1 : d});
const el = (tag, attrs, text) => { const e = document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]); if (text !== undefined) e.textContent = text; return e; };
function cards() {
  const tp = D.throughput || {};
  const c = [["Peak memory (XLA)", fmtB(M.peak_bytes)],
    ["Peak live buffers", M.live_peak_bytes == null ? "-" : fmtB(M.live_peak_bytes)], ["Arguments", fmtB(M.argument_bytes)],
    ["Temporaries", fmtB(M.temp_bytes)], ["GFLOP per run", fmt((P.flops || 0) / 1e9, 3)],
    ["Compile", fmt((D.compile || {}).total_seconds || 0, 2) + " s"],
    ["Samples/s", tp.runs ? fmt(tp.samples_per_second, 1) : "-"],
    ["Traced time per run", T.runs_traced ? fmt(T.total_us / T.runs_traced, 1) + " \u00b5s" : "-"]];
  const box = document.getElementById("cards");
  for (const [k, v] of c) { const d = el("div", {class: "card"}); d.append(el("b", {}, v), el("span", {}, k)); box.append(d); }
}
function table(id, cols, rows) {
  const t = document.getElementById(id), head = el("tr");
  cols.forEach(([key, label, num], i) => { const th = el("th", {class: num ? "n" : "", "data-col": i}, label);
    th.addEventListener("click", () => sortBy(t, i, num, th)); head.append(th); });
  const thead = el("thead"); thead.append(head); const tb = el("tbody");
  for (const r of rows) { const tr = el("tr");
    cols.forEach(([key, label, num, f]) => { const v = typeof key === "function" ? key(r) : r[key];
      const td = el("td", {class: num ? "n" : "", "data-v": num ? (+v || 0) : String(v == null ? "" : v)},
        f ? f(v) : (v == null ? "" : String(v))); tr.append(td); });
    tb.append(tr); }
  t.replaceChildren(thead, tb);
  if (!rows.length) { const tr = el("tr"); tr.append(el("td", {colspan: cols.length, class: "muted"}, "none")); tb.append(tr); }
}
function sortBy(t, i, num, th) {
  const asc = !th.classList.contains("asc");
  t.querySelectorAll("th").forEach(h => h.classList.remove("asc", "desc"));
  th.classList.add(asc ? "asc" : "desc");
  const tb = t.tBodies[0], rows = Array.from(tb.rows);
  const val = r => { const c = r.cells[i]; return c ? (num ? +c.dataset.v : c.dataset.v) : ""; };
  rows.sort((a, b) => { const x = val(a), y = val(b); const s = num ? x - y : String(x).localeCompare(String(y)); return asc ? s : -s; });
  tb.append(...rows);
}
function bars(id, rows, label, parts, fmtv) {
  const box = document.getElementById(id), W = 860, rowH = 18, left = 240;
  if (!rows.length) { box.append(el("p", {class: "muted"}, "no data")); return; }
  const max = Math.max(...rows.map(r => parts.reduce((s, p) => s + (+r[p[0]] || 0), 0))) || 1;
  const ns = "http://www.w3.org/2000/svg", svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", rows.length * rowH + 4); svg.setAttribute("role", "img");
  rows.forEach((r, i) => { const y = i * rowH + 2; let x = left;
    const tx = document.createElementNS(ns, "text"); tx.setAttribute("x", left - 6); tx.setAttribute("y", y + 12);
    tx.setAttribute("text-anchor", "end"); tx.textContent = String(r[label]).slice(0, 38); svg.append(tx);
    let total = 0;
    for (const [key, cls] of parts) { const v = +r[key] || 0; total += v; const w = (W - left - 170) * v / max;
      const rc = document.createElementNS(ns, "rect"); rc.setAttribute("x", x); rc.setAttribute("y", y);
      rc.setAttribute("width", Math.max(w, 0)); rc.setAttribute("height", rowH - 4); rc.setAttribute("class", cls);
      const tt = document.createElementNS(ns, "title"); tt.textContent = r[label] + ": " + fmtv(v); rc.append(tt);
      svg.append(rc); x += w; }
    const vt = document.createElementNS(ns, "text"); vt.setAttribute("x", x + 6); vt.setAttribute("y", y + 12);
    vt.textContent = fmtv(total); svg.append(vt); });
  box.append(svg);
}
function main() {
  cards();
  const runs = T.runs_traced || 1, nodes = T.per_node || [];
  const memBy = {}; for (const r of M.by_node || []) memBy[r.node] = r.bytes;
  const per = r => ({...r, fwd: r.forward_us / runs, bwd: r.backward_us / runs});
  bars("time-chart", nodes.filter(r => r.us > 0).slice(0, 20).map(per), "node",
    [["fwd", "bar"], ["bwd", "bar bwd"]], v => fmt(v, 1) + " \u00b5s");
  document.getElementById("node-note").textContent = (P.nodes || nodes.length) + " nodes; " +
    (T.runs_traced ? T.runs_traced + " traced run(s), " + fmt(T.total_us / runs, 1) + " \u00b5s per run" : "no run traced yet") +
    ((T.unattributed || []).length ? "; not in any node (the step's own work): " +
      T.unattributed.slice(0, 6).map(u => u.op + " " + fmt(u.us / runs, 1) + " \u00b5s").join(", ") : "");
  const pct = v => fmt(100 * v, 1) + " %";
  table("nodes", [["node", "Node"], ["op_type", "Op type"], ["us_per_run", "\u00b5s / run", 1, v => fmt(v, 2)],
    [r => r.forward_us / runs, "Forward \u00b5s", 1, v => fmt(v, 2)], [r => r.backward_us / runs, "Backward \u00b5s", 1, v => fmt(v, 2)],
    ["share", "Share", 1, pct], [r => (r.fused_us || 0) / runs, "In fusions \u00b5s", 1, v => fmt(v, 2)],
    [r => (r.events || 0) / runs, "Events / run", 1, v => fmt(v, 1)],
    [r => memBy[r.node] || 0, "Live at peak", 1, fmtB]], nodes);
  table("optypes", [["op_type", "Op type"], ["nodes", "Nodes", 1, v => fmt(v, 0)], ["us_per_run", "\u00b5s / run", 1, v => fmt(v, 2)],
    ["share", "Share", 1, pct]], T.per_op_type || []);
  table("fusions", [[r => r.nodes.join(" + "), "Nodes"], [r => r.instructions.join(", "), "XLA instructions"],
    ["us_per_run", "\u00b5s / run", 1, v => fmt(v, 2)], ["share", "Share", 1, pct]], T.fusions || []);
  bars("mem-chart", (M.by_node || []).slice(0, 20), "node", [["bytes", "bar mem"]], fmtB);
  table("buffers", [["buffer", "XLA buffer"], ["node", "Node"], ["pass", "Pass"], ["bytes", "Bytes", 1, fmtB],
    ["op_name", "op_name"]], M.live_at_peak || []);
  const ph = Object.entries((D.compile || {}).phases || {}).map(([k, v]) => ({phase: k, seconds: v}));
  table("phases", [["phase", "Compile phase"], ["seconds", "Seconds", 1, v => fmt(v, 3)]], ph);
  bars("runs-chart", (D.runs || []).slice(-20).map(r => ({...r, label: "run " + r.run + (r.traced ? " (traced)" : "")})),
    "label", [["samples_per_second", "bar"]], v => fmt(v, 1) + " samples/s");
}
main();
</script>
</body></html>
""")


def render(data: Mapping[str, Any]) -> str:
    """The HTML page of a report's data."""
    p = data.get("program", {})
    title = f"PopART-XLA report: {p.get('session', '')}"
    subtitle = (f"{p.get('kind', '')} on {p.get('platform', '')} {', '.join(p.get('devices', []))} "
                f"· module {p.get('module', '')} · {data.get('created', '')} · schema {data.get('schema', '')}")
    payload = json.dumps(data).replace("</", "<\\/").replace("<!--", "<\\!--")
    return _PAGE.substitute(title=html.escape(title), subtitle=html.escape(subtitle), data=payload)
