// laneserve dashboard: polls /dashboard/data (live) or pages /dashboard/history, draws
// the charts with the vendored uPlot and the lanes timeline on a plain canvas.
"use strict";
(function () {
  const LIVE_POINTS = 900; // 15 min of 1 s points
  const COLORS = ["#4f8cff", "#f5a524", "#17c964", "#f31260", "#7828c8", "#0e8a8a", "#8a6d0e"];
  const REASONS = ["stop", "length", "abort", "error"];
  const PCT = ["p50", "p90", "p99"];
  const ms = (key, i) => (p) => (p[key] && p[key][i] != null ? p[key][i] * 1000 : null);
  const field = (key) => (p) => (p[key] == null ? null : p[key]);
  const latency = (key) => PCT.map((name, i) => [name, ms(key, i)]);
  const SPECS = {
    throughput: [["prompt", field("prompt_tps")], ["generation", field("gen_tps")]],
    requests: [["running", field("running")], ["waiting", field("waiting")]],
    finished: REASONS.map((r) => [r, field("fin_" + r)]),
    cache: [["KV cache use", field("kv_usage")], ["prefix-cache hit rate", field("prefix_hit_rate")]],
    ttft: latency("ttft"),
    tpot: latency("tpot"),
    itl: latency("itl"),
    e2e: latency("e2e"),
    spec_accept: [], // one series per draft position, known from the data
    spec_len: [["mean accepted length", field("spec_mean_len")]],
    lanes_stats: [["host gap (ms)", field("host_gap_ms")], ["device busy (share)", field("device_busy")]],
  };
  const charts = {};
  const state = { range: "live", points: [], lastT: 0, info: null, lanes: [], timer: null, busy: false };
  window.laneserveDashboard = { charts: charts, state: state };

  function specSeries(points) {
    let n = 0;
    for (const p of points) n = Math.max(n, (p.spec_accept || []).length);
    const out = [];
    for (let i = 0; i < n; i++) {
      out.push(["position " + i, (p) => (p.spec_accept && p.spec_accept[i] != null ? p.spec_accept[i] : null)]);
    }
    return out;
  }

  function seriesOf(name, points) {
    return name === "spec_accept" ? specSeries(points) : SPECS[name];
  }

  function draw(name, points) {
    const el = document.getElementById("chart-" + name);
    const series = seriesOf(name, points);
    const xs = points.map((p) => p.t);
    const data = [xs].concat(series.map(([, get]) => points.map(get)));
    const hasData = data.slice(1).some((col) => col.some((v) => v != null));
    let chart = charts[name];
    if (chart && chart.series.length !== series.length + 1) {
      chart.destroy();
      chart = null;
    }
    if (!hasData) {
      if (chart) chart.destroy();
      delete charts[name];
      el.dataset.points = "0";
      if (!el.querySelector(".empty")) {
        el.textContent = "";
        const note = document.createElement("div");
        note.className = "empty";
        note.textContent = name.startsWith("spec") ? "no speculative decoding steps in this range" : "no data in this range yet";
        el.appendChild(note);
      }
      return;
    }
    if (!chart) {
      el.textContent = "";
      const opts = {
        width: Math.max(200, el.clientWidth),
        height: 200,
        scales: { x: { time: true } },
        series: [{}].concat(
          series.map(([label], i) => ({ label: label, stroke: COLORS[i % COLORS.length], width: 1.5 }))
        ),
        axes: [{}, { size: 55 }],
        legend: { live: true },
      };
      chart = new uPlot(opts, data, el);
      charts[name] = chart;
    } else {
      chart.setData(data);
    }
    el.dataset.points = String(data.slice(1).reduce((n, col) => n + col.filter((v) => v != null).length, 0));
  }

  function drawAll() {
    for (const name of Object.keys(SPECS)) draw(name, state.points);
    drawLanes(state.lanes);
    drawSummary();
  }

  // -- the lanes timeline ------------------------------------------------------
  const LANES = ["prepare", "device", "output"];
  function drawLanes(steps) {
    const canvas = document.getElementById("lanes");
    const note = document.getElementById("lanes-note");
    const width = Math.max(300, canvas.clientWidth);
    const ratio = window.devicePixelRatio || 1;
    const height = 170;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.clearRect(0, 0, width, height);
    canvas.dataset.steps = String(steps.length);
    if (!steps.length) {
      note.textContent = "no steps yet (the timeline fills while the server runs requests)";
      return;
    }
    const left = 70;
    const t0 = Math.min(...steps.map((s) => s.prepare[0]));
    const t1 = Math.max(...steps.map((s) => s.output[1]));
    const scale = (width - left - 10) / Math.max(1, t1 - t0);
    const x = (t) => left + (t - t0) * scale;
    ctx.font = "12px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    let gaps = 0;
    LANES.forEach((lane, row) => {
      const y = 12 + row * 42;
      ctx.fillStyle = "#1d2330";
      ctx.fillText(lane, 4, y + 14);
      steps.forEach((s) => {
        ctx.fillStyle = COLORS[s.step % 2 === 0 ? 0 : 4];
        ctx.fillRect(x(s[lane][0]), y, Math.max(1, (s[lane][1] - s[lane][0]) * scale), 28);
      });
      if (lane === "device") {
        steps.forEach((s, i) => {
          if (i === 0 || s.gap_us == null || s.gap_us <= 0) return;
          gaps += 1;
          ctx.fillStyle = "rgba(243, 18, 96, 0.55)";
          ctx.fillRect(x(s.device[0] - s.gap_us), y + 10, Math.max(1, s.gap_us * scale), 8);
        });
      }
    });
    ctx.fillStyle = "#5a6375";
    const spanMs = (t1 - t0) / 1000;
    ctx.fillText("0 ms", left, 150);
    ctx.fillText(spanMs.toFixed(1) + " ms", width - 70, 150);
    canvas.dataset.gaps = String(gaps);
    const g = steps.filter((s) => s.gap_us != null).map((s) => s.gap_us / 1000);
    g.sort((a, b) => a - b);
    const median = g.length ? g[Math.floor(g.length / 2)] : null;
    note.textContent =
      "steps " + steps[0].step + "–" + steps[steps.length - 1].step +
      " (" + spanMs.toFixed(1) + " ms); red: host gap before a device span" +
      (median == null ? "" : ", median " + median.toFixed(2) + " ms");
  }

  // -- summary and server info ---------------------------------------------------
  function fmt(v, digits) {
    return v == null ? "–" : Number(v).toFixed(digits);
  }
  function drawSummary() {
    const p = state.points.length ? state.points[state.points.length - 1] : {};
    const info = state.info || {};
    const items = [
      ["prompt tok/s", fmt(p.prompt_tps, 1)],
      ["generation tok/s", fmt(p.gen_tps, 1)],
      ["running", fmt(p.running, 0)],
      ["waiting", fmt(p.waiting, 0)],
      ["KV cache use", p.kv_usage == null ? "–" : (100 * p.kv_usage).toFixed(1) + "%"],
      ["prefix hit rate", p.prefix_hit_rate == null ? "–" : (100 * p.prefix_hit_rate).toFixed(1) + "%"],
      ["uptime", info.uptime_s == null ? "–" : formatDuration(info.uptime_s)],
      ["worker restarts", info.worker_restarts == null ? "–" : String(info.worker_restarts)],
    ];
    const box = document.getElementById("summary");
    box.textContent = "";
    for (const [label, value] of items) {
      const span = document.createElement("span");
      span.append(label + ": ");
      const b = document.createElement("b");
      b.textContent = value;
      span.appendChild(b);
      box.appendChild(span);
    }
  }
  function formatDuration(s) {
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
    return h ? h + " h " + m + " min" : m ? m + " min " + Math.floor(s % 60) + " s" : Math.floor(s) + " s";
  }
  function fillTable(id, rows, head) {
    const table = document.getElementById(id);
    table.textContent = "";
    if (head) {
      const tr = table.insertRow();
      for (const h of head) {
        const th = document.createElement("th");
        th.textContent = h;
        tr.appendChild(th);
      }
    }
    for (const row of rows) {
      const tr = table.insertRow();
      for (const cell of row) tr.insertCell().textContent = cell == null ? "–" : String(cell);
    }
  }
  function drawInfo(info) {
    document.getElementById("model").textContent = info.model;
    document.getElementById("status").textContent = info.ready ? "ready" : "loading the model…";
    fillTable("info-model", [
      ["model", info.model], ["device", info.device], ["weights", info.weight_dtype],
      ["kernels", info.kernels], ["max model len", info.max_model_len], ["block size", info.block_size],
      ["scheduling", info.async_scheduling == null ? null : info.async_scheduling ? "async (depth 2)" : "sync"],
      ["history", "a point every " + info.sample_s + " s, kept " + (info.retention_s / 3600).toFixed(1) + " h"],
    ]);
    fillTable("info-groups", (info.cache_groups || []).map((g) => [g.name, g.kind, g.num_blocks, g.block_size, g.window || ""]),
      ["cache group", "kind", "blocks", "block size", "window"]);
    fillTable("info-flags", Object.entries(info.flags || {}));
  }

  // -- fetching ------------------------------------------------------------------
  async function getJSON(url) {
    const r = await fetch(url, { credentials: "same-origin" });
    if (r.status === 401) {
      window.location.reload(); // the page answers with its login form
      throw new Error("unauthorized");
    }
    if (!r.ok) throw new Error(url + ": HTTP " + r.status);
    return r.json();
  }
  async function pollLive() {
    const d = await getJSON("/dashboard/data?since=" + state.lastT);
    if (state.range !== "live") return;
    state.info = d.info;
    state.lanes = d.lanes;
    drawInfo(d.info);
    state.points = state.points.concat(d.points).slice(-LIVE_POINTS);
    if (state.points.length) state.lastT = state.points[state.points.length - 1].t;
    drawAll();
  }
  async function loadHistory(seconds) {
    const points = [];
    let since = Date.now() / 1000 - seconds;
    for (let page = 0; page < 50; page++) {
      const d = await getJSON("/dashboard/history?limit=5000&since=" + since);
      points.push(...d.points);
      if (d.next == null) break;
      since = d.next;
    }
    const live = await getJSON("/dashboard/data?since=" + Date.now() / 1000);
    if (state.range !== String(seconds)) return;
    state.info = live.info;
    state.lanes = live.lanes;
    drawInfo(live.info);
    state.points = points;
    drawAll();
  }
  async function refresh() {
    if (state.busy) return;
    state.busy = true;
    try {
      if (state.range === "live") await pollLive();
      else await loadHistory(Number(state.range));
    } catch (e) {
      document.getElementById("status").textContent = "no answer from the server (" + e.message + ")";
    } finally {
      state.busy = false;
    }
  }
  function setRange(range) {
    state.range = range;
    state.points = [];
    state.lastT = 0;
    for (const b of document.querySelectorAll("#ranges button")) b.classList.toggle("on", b.dataset.range === range);
    clearInterval(state.timer);
    state.timer = setInterval(refresh, range === "live" ? 1000 : 10000);
    refresh();
  }
  for (const b of document.querySelectorAll("#ranges button")) b.addEventListener("click", () => setRange(b.dataset.range));
  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(charts)) {
      const el = document.getElementById("chart-" + name);
      chart.setSize({ width: Math.max(200, el.clientWidth), height: 200 });
    }
    drawLanes(state.lanes);
  });
  setRange("live");
})();
