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

function view() { return new URLSearchParams(location.hash.slice(1)); }

function selected() {
  const hash = view().get("runs");
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
  if (data.ids) for (const id of [...runs.keys()]) if (!data.ids.includes(id)) runs.delete(id);  // removed
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
  renderSteps(shown);
  const stepShown = view().has("step");
  document.getElementById("overview").hidden = stepShown;
  document.getElementById("step-view").hidden = !stepShown;
  if (!stepShown) for (const chart of CHARTS) renderChart(chart, shown);
}

function link(params) {
  const next = view();
  for (const [key, value] of Object.entries(params)) value === null ? next.delete(key) : next.set(key, value);
  return `#${next.toString()}`;
}

function renderSteps(shown) {  // each run's steps, newest first, each a link to its rollouts
  document.getElementById("steps").innerHTML = shown.map((id) => {
    const steps = trainingSteps(runs.get(id).entries).reverse();
    return `<p>steps of ${esc(id)}: ` + steps.map((e) =>
      `<a href="${esc(link({ run: id, step: e.step }))}" data-step="${e.step}">${e.step}</a>`).join("") + "</p>";
  }).join("");
}

async function showStep() {
  const params = view(), box = document.getElementById("step-view");
  if (!params.has("step")) return;
  const run = params.get("run"), step = params.get("step");
  const back = `<p><a href="${esc(link({ run: null, step: null, full: null }))}">← all steps</a></p>`;
  box.innerHTML = back + `<h2>step ${esc(step)} of ${esc(run)}</h2><p>loading…</p>`;
  let data;
  try {
    const full = params.has("full") ? "&full=1" : "";
    const response = await fetch(`${api("/api/rollouts")}&run=${encodeURIComponent(run)}&step=${encodeURIComponent(step)}${full}`);
    data = await response.json();
  } catch (e) {
    data = { groups: [], error: `the dashboard is not answering (${e.message})` };
  }
  const problems = (data.problems || []).map((p) => `<div class="message warn">${esc(p)}</div>`).join("");
  const error = data.error ? `<div class="message" id="step-error">${esc(data.error)}</div>` : "";
  box.innerHTML = back + `<h2>step ${esc(step)} of ${esc(run)}</h2>` + error + problems +
    data.groups.map(renderGroup).join("");
}

function renderGroup(group, g) {
  const order = group.trajectories.map((t, i) => [t, i]).sort((a, b) => b[0].reward - a[0].reward);
  return `<div class="group" data-group="${g}"><h3>group ${g}` +
    (group.skipped ? ` <span class="skip">left out: ${esc(group.skipped)}</span>` : "") + "</h3>" +
    order.map(([t, i]) => `<details class="trajectory" data-trajectory="${i}"><summary>trajectory ${i}: ` +
      `reward ${fmt(t.reward)}, advantage ${t.advantage === null ? "–" : fmt(t.advantage)}` +
      (t.skipped ? ` <span class="skip">left out: ${esc(t.skipped)}</span>` : "") + "</summary>" +
      t.messages.map(renderTurn).join("") + "</details>").join("") + "</div>";
}

function renderTurn(m) {
  const text = typeof m.content === "string" ? m.content : m.content ? JSON.stringify(m.content) : "";
  const cut = m.cut ? ` <a href="${esc(link({ full: 1 }))}">… ${m.cut} characters: show all</a>` : "";
  return `<div class="turn" data-role="${esc(m.role)}"><span class="role">${esc(m.role)}</span>\n` +
    (m.reasoning_content ? `<span class="reasoning">reasoning: ${esc(m.reasoning_content)}</span>\n` : "") +
    esc(text) + cut + (m.tool_calls ? `\n<span class="role">tool calls</span> ${esc(JSON.stringify(m.tool_calls))}` : "") +
    "</div>";
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

window.addEventListener("hashchange", () => {
  for (const id in plots) { plots[id].plot.destroy(); delete plots[id]; }
  render();
  showStep();
});
window.addEventListener("resize", () => { for (const id in plots) plots[id].plot.setSize({ width: Math.max(300, document.getElementById(`chart-${id}`).clientWidth - 20), height: 220 }); });
start().then(showStep);
