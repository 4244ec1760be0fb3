// The dashboard's page: runs from /api/runs, then their new lines as Server-Sent Events (/api/events), drawn with
// uPlot. The URL's hash names the runs shown (#runs=project/name,...), so a view is a link.
"use strict";
const TOKEN = document.body.dataset.token;
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
const CHARTS = [
  { id: "reward", key: "train/reward", spread: "train/reward_std_dev" },
  { id: "loss", key: "train/loss" },
  { id: "wall", key: "time/step_wall_s" },
];
const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];  // steps are whole
const runs = new Map();  // id -> {id, project, name, entries, problems}
const plots = {};  // chart id -> {plot, layout}
let rootError = null;

function api(path) { return `${path}?token=${encodeURIComponent(TOKEN)}`; }

function selected() {
  const hash = new URLSearchParams(location.hash.slice(1)).get("runs");
  const ids = hash ? hash.split(",").filter((id) => runs.has(id)) : [];
  return ids.length ? ids : [...runs.keys()];
}

function trainingSteps(entries) {  // a line per step (the last one of a step trained twice), as art-sky plot reads it
  const steps = new Map();
  for (const e of entries) if (Object.keys(e).some((k) => k.startsWith("train/"))) steps.set(e.step, e);
  return [...steps.keys()].sort((a, b) => a - b).map((s) => steps.get(s));
}

function apply(data, replace) {
  rootError = data.error;
  document.getElementById("root").textContent = data.root;
  if (replace) runs.clear();
  for (const run of data.runs) {
    const old = runs.get(run.id);
    const entries = old && run.start ? old.entries.slice(0, run.start).concat(run.entries) : run.entries;
    runs.set(run.id, { ...run, entries });
  }
  render();
}

function render() {
  const error = document.getElementById("error");
  error.hidden = !rootError;
  error.textContent = rootError || "";
  const problems = [...runs.values()].flatMap((r) => r.problems);
  const box = document.getElementById("problems");
  box.hidden = !problems.length;
  box.textContent = problems.join("\n");
  const shown = selected();
  renderPicker(shown);
  renderLatest(shown);
  for (const chart of CHARTS) renderChart(chart, shown);
}

function renderPicker(shown) {
  const list = document.getElementById("runs");
  list.replaceChildren(...[...runs.keys()].sort().map((id, i) => {
    const li = document.createElement("li");
    const box = Object.assign(document.createElement("input"), { type: "checkbox", checked: shown.includes(id) });
    box.addEventListener("change", () => {
      const ids = [...list.querySelectorAll("input")].filter((b) => b.checked).map((b) => b.value);
      location.hash = `runs=${ids.join(",")}`;
    });
    box.value = id;
    const label = document.createElement("label");
    label.style.color = COLORS[i % COLORS.length];
    label.append(box, ` ${id}`);
    li.append(label);
    return li;
  }));
}

function esc(text) { return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`); }

function short(v) { return v === 0 ? "0" : String(Number(v.toPrecision(3))); }  // 1e-8, not "-0"

function fmt(v, digits = 3) { return v === undefined ? "–" : Number(v).toFixed(digits); }

function renderLatest(shown) {
  const rows = shown.map((id) => {
    const steps = trainingSteps(runs.get(id).entries);
    const last = steps[steps.length - 1] || {};
    return `<tr data-run="${esc(id)}"><td>${esc(id)}</td><td>${last.step ?? "–"}</td><td>${fmt(last["train/reward"])}</td>` +
      `<td>${fmt(last["train/loss"], 4)}</td><td>${fmt(last["time/step_wall_s"], 2)}</td>` +
      `<td>${fmt(last["costs/cum/gpu"], 4)}</td></tr>`;
  });
  document.getElementById("latest").innerHTML = rows.length ?
    "<table><tr><th>run</th><th>step</th><th>reward</th><th>loss</th><th>wall s</th><th>$ so far</th></tr>" +
    rows.join("") + "</table>" : "";
}

function color(id) { return COLORS[[...runs.keys()].sort().indexOf(id) % COLORS.length]; }

function renderChart(chart, shown) {
  const tables = [], series = [{ label: "step" }], bands = [];
  let points = 0;
  for (const id of shown) {
    const steps = trainingSteps(runs.get(id).entries).filter((e) => typeof e[chart.key] === "number");
    points += steps.length;
    const xs = steps.map((e) => e.step), mean = steps.map((e) => e[chart.key]);
    series.push({ label: id, stroke: color(id), width: 2, points: { show: true, size: 5 } });
    if (chart.spread && steps.every((e) => typeof e[chart.spread] === "number")) {
      const sd = steps.map((e) => e[chart.spread]);
      tables.push([xs, mean, mean.map((m, i) => m + sd[i]), mean.map((m, i) => m - sd[i])]);
      const at = series.length;
      series.push({ label: `${id} +std`, stroke: "transparent", class: "spread" },
                  { label: `${id} −std`, stroke: "transparent", class: "spread" });
      bands.push({ series: [at, at + 1], fill: color(id) + "33" });
    } else {
      tables.push([xs, mean]);
    }
  }
  const el = document.getElementById(`chart-${chart.id}`);
  el.dataset.points = points;
  el.querySelector("h3").dataset.empty = points ? "" : ` (none yet: no step has ${chart.key})`;
  const data = tables.length ? uPlot.join(tables) : [[]];
  const layout = series.map((s) => s.label).join("|");
  const old = plots[chart.id];
  if (old && old.layout === layout) { old.plot.setData(data); return; }
  if (old) old.plot.destroy();
  const opts = {
    width: Math.max(300, el.clientWidth - 20), height: 220, series, bands,
    scales: { x: { time: false } }, legend: { show: true },
    axes: [{ label: "training step", incrs: STEP_INCRS }, { values: (u, ticks) => ticks.map(short), size: 60 }],
  };
  plots[chart.id] = { plot: new uPlot(opts, data, el), layout };
}

function status(state, text) {
  const el = document.getElementById("status");
  el.dataset.state = state;
  el.textContent = text;
}

async function start() {
  try {
    const response = await fetch(api("/api/runs"));
    if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
    apply(await response.json(), true);
  } catch (e) {
    rootError = `the dashboard could not read the runs: ${e.message}`;
    render();
  }
  const events = new EventSource(api("/api/events"));
  events.addEventListener("runs", (e) => {
    apply(JSON.parse(e.data), false);
    status("live", `live: updated ${new Date().toLocaleTimeString()}`);
  });
  events.onopen = () => status("live", "live");
  events.onerror = () => status("lost", "the dashboard is not answering: showing what it last sent");
}

window.addEventListener("hashchange", () => { for (const id in plots) { plots[id].plot.destroy(); delete plots[id]; } render(); });
window.addEventListener("resize", () => { for (const id in plots) plots[id].plot.setSize({ width: Math.max(300, document.getElementById(`chart-${id}`).clientWidth - 20), height: 220 }); });
start();
