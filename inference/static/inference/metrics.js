/* Live metric charts of a deployment, drawn with uPlot (inference/vendor/uplot/, loaded first).
 *
 * The page (templates/admin/inference/deployment/metrics.html) holds one <figure data-chart> per
 * chart of inference.selectors.CHARTS. Every few seconds this fetches the JSON of
 * inference.selectors.deployment_metric_series from #metrics-app[data-url]:
 *   {since, now, deployment, charts: [{id, title, unit, source, fields, per_worker}],
 *    series: {role: {t: [epoch ms], <field>: [number|null]}},          // per role
 *    workers: [{id, name, role, url, t, <field>: [...]}],             // the most loaded workers'
 *    workers_total,                                                    // workers with samples
 *    router: {t, <field>: [...]}, router_metrics: {field: {label}},   // the router's
 *    events: [{t, role, from, to, source, reason}]}
 * and gives each chart its lines: a router chart one per field, a "worker" chart one per worker, a
 * "role" chart one per role, or one per worker when the page's "Series" toggle says "per worker".
 * Scale events are dashed vertical lines (refused placements dotted red, their label marked ✗). The uPlot instances are in window.metricsCharts (by chart
 * id), where the browser tests read their series and data.
 */
(function () {
  "use strict";

  var ROLE_COLOURS = { prefill: "#1565c0", decode: "#e65100" };
  var PALETTE = ["#1565c0", "#e65100", "#2e7d32", "#6a1b9a", "#00838f", "#c62828", "#5d4037", "#ad1457",
    "#9e9d24", "#283593"];
  var FIELD_COLOURS = ["#1565c0", "#e65100", "#2e7d32"];
  var EVENT_COLOUR = "#7b1fa2";
  var REFUSED_COLOUR = "#c62828";  // scale events whose workers no node could take
  var HEIGHT = 190;
  var MIN_GAP_MS = 15000;  // a silence longer than this (and than 3 sampling periods) breaks a line

  function pad2(n) { return (n < 10 ? "0" : "") + n; }

  function scaled(v, steps, names) {
    var i = 0;
    while (Math.abs(v) >= steps && i < names.length - 1) { v /= steps; i += 1; }
    return (Math.abs(v) >= 100 || Math.round(v) === v ? v.toFixed(0) : v.toFixed(1)) + " " + names[i];
  }

  function defined(v) { return v !== null && v !== undefined; }

  /* Indexes of the values uPlot's line would not show: no value before or after them, or a gap. */
  function isolated(column) {
    var found = [];
    var previous = null;  // the last entry that is not undefined (undefined entries are drawn across)
    for (var i = 0; i < column.length; i += 1) {
      if (column[i] === undefined) { continue; }
      if (defined(column[i]) && !defined(previous)) {
        var next = null;
        for (var j = i + 1; j < column.length; j += 1) { if (column[j] !== undefined) { next = column[j]; break; } }
        if (!defined(next)) { found.push(i); }
      }
      previous = column[i];
    }
    return found;
  }

  function countValues(column) {
    var n = 0;
    for (var i = 0; i < column.length; i += 1) { if (defined(column[i])) { n += 1; } }
    return n;
  }

  /* Points: all of them on a sparse line, else only those no line segment shows (a lone sample). */
  var POINTS = {
    size: 5,
    show: function (u, si) { return countValues(u.data[si]) <= 30; },
    filter: function (u, si, show) { return show ? null : isolated(u.data[si]); },
  };

  function formatValue(v, unit) {
    if (v === null || v === undefined || isNaN(v)) { return "–"; }
    if (v === 0) { return unit === "ratio" ? "0%" : "0"; }
    if (unit === "ratio") { return (v * 100).toFixed(Math.abs(v) < 0.1 ? 1 : 0) + "%"; }
    if (unit === "s") {
      if (Math.abs(v) < 0.001) { return (v * 1e6).toFixed(0) + " µs"; }
      if (Math.abs(v) < 1) { return (v * 1000).toFixed(Math.abs(v) < 0.01 ? 1 : 0) + " ms"; }
      return v.toFixed(2) + " s";
    }
    if (unit === "bytes") { return scaled(v, 1024, ["B", "KiB", "MiB", "GiB", "TiB"]); }
    if (unit === "bytes/s") { return scaled(v, 1024, ["B/s", "KiB/s", "MiB/s", "GiB/s"]); }
    if (Math.abs(v) >= 10000) { return (v / 1000).toFixed(0) + "k"; }
    if (Math.abs(v) >= 1000) { return (v / 1000).toFixed(1) + "k"; }
    if (Math.abs(v) >= 10 || Math.round(v) === v) { return v.toFixed(0); }
    return v.toFixed(2);
  }

  function formatTime(ms, spanMs) {
    var d = new Date(ms);
    var hm = pad2(d.getHours()) + ":" + pad2(d.getMinutes());
    if (spanMs <= 20 * 60 * 1000) { return hm + ":" + pad2(d.getSeconds()); }
    if (spanMs > 36 * 3600 * 1000) { return (d.getMonth() + 1) + "/" + d.getDate() + " " + hm; }
    return hm;
  }

  function median(values) {
    if (!values.length) { return 0; }
    var sorted = values.slice().sort(function (a, b) { return a - b; });
    return sorted[Math.floor(sorted.length / 2)];
  }

  /* The lines of one chart: [{label, colour, t: [ms], v: [number|null]}]. */
  function linesOf(spec, payload, split) {
    var lines = [];
    var field = spec.fields[0];
    if (spec.source === "router") {
      var router = payload.router || { t: [] };
      var meta = payload.router_metrics || {};
      spec.fields.forEach(function (name, index) {
        lines.push({ label: (meta[name] && meta[name].label) || name, colour: FIELD_COLOURS[index % FIELD_COLOURS.length],
          t: router.t || [], v: router[name] || [] });
      });
    } else if (spec.source === "worker" || (split === "worker" && spec.per_worker)) {
      (payload.workers || []).forEach(function (worker, index) {
        lines.push({ label: worker.name, colour: PALETTE[index % PALETTE.length], t: worker.t || [],
          v: worker[field] || [] });
      });
    } else {
      Object.keys(payload.series || {}).forEach(function (role, index) {
        var series = payload.series[role];
        lines.push({ label: role, colour: ROLE_COLOURS[role] || PALETTE[(index + 2) % PALETTE.length],
          t: series.t || [], v: series[field] || [] });
      });
    }
    return lines;
  }

  /* uPlot's data ([x in seconds, one y array per line]) over the union of the lines' times. A point a
   * line lacks is `undefined` (uPlot draws across it) unless it falls inside a long silence of that
   * line, where it is `null` (a gap); each silence gets a time of its own so that it always shows. */
  function align(lines) {
    var times = {};
    var silences = lines.map(function (line) {
      var gaps = [];
      for (var k = 1; k < line.t.length; k += 1) { gaps.push(line.t[k] - line.t[k - 1]); }
      var maxGap = Math.max(3 * median(gaps), MIN_GAP_MS);
      var found = [];
      line.t.forEach(function (t, i) {
        times[t] = true;
        if (i > 0 && t - line.t[i - 1] > maxGap) {
          found.push([line.t[i - 1], t]);
          times[line.t[i - 1] + 1] = true;
        }
      });
      return found;
    });
    var xs = Object.keys(times).map(Number).sort(function (a, b) { return a - b; });
    var data = [xs.map(function (t) { return t / 1000; })];
    lines.forEach(function (line, index) {
      var at = {};
      line.t.forEach(function (t, i) { at[t] = line.v[i]; });
      var column = xs.map(function (t) {
        if (Object.prototype.hasOwnProperty.call(at, t)) { return at[t] === undefined ? null : at[t]; }
        var inSilence = silences[index].some(function (gap) { return t > gap[0] && t < gap[1]; });
        return inSilence ? null : undefined;
      });
      data.push(column);
    });
    return data;
  }

  function hasValues(data) {
    for (var i = 1; i < data.length; i += 1) {
      if (countValues(data[i])) { return true; }
    }
    return false;
  }

  /* A uPlot plugin drawing the scale events of the current payload as dashed lines with labels. */
  function eventsPlugin(chart) {
    return {
      hooks: {
        draw: [function (u) {
          var payload = chart.payload;
          if (!payload) { return; }
          var ctx = u.ctx;
          var ratio = window.devicePixelRatio || 1;
          var top = u.bbox.top;
          var bottom = u.bbox.top + u.bbox.height;
          var right = u.bbox.left + u.bbox.width;
          ctx.save();
          ctx.strokeStyle = EVENT_COLOUR;
          ctx.fillStyle = EVENT_COLOUR;
          ctx.lineWidth = ratio;
          ctx.font = Math.round(11 * ratio) + "px sans-serif";
          ctx.textBaseline = "top";
          var labelEnds = [];  // right edge of the last label drawn on each text row
          (payload.events || []).forEach(function (event) {
            var x = Math.round(u.valToPos(event.t / 1000, "x", true)) + 0.5;
            if (x < u.bbox.left || x > right) { return; }
            // A refused placement changed nothing: a dotted red line and a struck label ("d→2 ✗").
            var colour = event.refused ? REFUSED_COLOUR : EVENT_COLOUR;
            ctx.strokeStyle = colour;
            ctx.fillStyle = colour;
            ctx.setLineDash(event.refused ? [1 * ratio, 3 * ratio] : [3 * ratio, 3 * ratio]);
            ctx.beginPath();
            ctx.moveTo(x, top);
            ctx.lineTo(x, bottom);
            ctx.stroke();
            ctx.setLineDash([]);
            var text = event.role.charAt(0) + "→" + event.to + (event.refused ? " ✗" : "");
            var width = ctx.measureText(text).width;
            var fitsRight = x + 3 * ratio + width <= right;
            var start = fitsRight ? x + 3 * ratio : x - 3 * ratio - width;
            // Labels that would overlap an earlier one go on the next row down (at most 4 rows).
            var row = 0;
            while (row < 3 && labelEnds[row] !== undefined && start < labelEnds[row] + 4 * ratio) { row += 1; }
            labelEnds[row] = start + width;
            ctx.textAlign = "left";
            ctx.fillText(text, start, top + ratio + row * 13 * ratio);
          });
          ctx.restore();
        }],
      },
    };
  }

  /* The y axis as wide as its longest label (a fixed 64 px cut "1.4 MiB/s" to ".4 MiB/s"): uPlot asks on
   * each layout cycle with the labels it formatted (none on the first). */
  var MIN_AXIS_PX = 40;
  function axisSize(u, values, axisIdx, cycleNum) {
    var axis = u.axes[axisIdx];
    if (cycleNum > 1) { return axis._size; }  // settled: keep the size (uPlot re-asks until stable)
    var size = axis.ticks.size + axis.gap;
    var longest = (values || []).reduce(function (a, v) { return v && v.length > a.length ? v : a; }, "");
    if (longest) {
      u.ctx.font = axis.font[0];
      size += u.ctx.measureText(longest).width / (window.devicePixelRatio || 1);
    }
    return Math.ceil(Math.max(size, MIN_AXIS_PX)) + 4;
  }

  function Chart(figure, registry) {
    this.figure = figure;
    this.id = figure.getAttribute("data-chart");
    this.unit = figure.getAttribute("data-unit");
    this.holder = figure.querySelector(".metrics-plot");
    this.empty = figure.querySelector(".metrics-empty");
    this.noGpu = figure.querySelector(".metrics-no-gpu");  // GPU charts: said instead of an empty chart
    this.registry = registry;
    this.plot = null;
    this.key = null;
    this.payload = null;
  }

  Chart.prototype.width = function () {
    return Math.max(this.holder.clientWidth || this.figure.clientWidth - 16 || 400, 200);
  };

  Chart.prototype.options = function (lines) {
    var self = this;
    var unit = this.unit;
    return {
      width: this.width(),
      height: HEIGHT,
      plugins: [eventsPlugin(this)],
      cursor: { drag: { x: false, y: false } },
      scales: {
        // The window of the latest payload, even where samples do not reach its ends.
        x: { time: true, range: function () {
          var since = Date.parse(self.payload.since) / 1000;
          var now = Date.parse(self.payload.now) / 1000;
          return [since, now > since ? now : since + 1];
        } },
        y: {
          range: function (u, min, max) {
            var top = max === null || max === undefined || isNaN(max) ? 0 : max;
            if (unit === "ratio") { top = Math.max(top, 1); }
            if (top <= 0) { top = 1; }
            return [0, top * (unit === "ratio" && top <= 1 ? 1 : 1.1)];
          },
        },
      },
      axes: [
        { stroke: "currentColor", grid: { stroke: "rgba(128,128,128,0.2)" },
          values: function (u, splits) {
            var span = (u.scales.x.max - u.scales.x.min) * 1000;
            return splits.map(function (v) { return formatTime(v * 1000, span); });
          } },
        { stroke: "currentColor", grid: { stroke: "rgba(128,128,128,0.2)" }, size: axisSize,
          values: function (u, splits) { return splits.map(function (v) { return formatValue(v, unit); }); } },
      ],
      series: [{ value: function (u, v) { return v === null ? "–" : formatTime(v * 1000, 0); } }].concat(
        lines.map(function (line) {
          return { label: line.label, stroke: line.colour, width: 1.6, spanGaps: false, points: POINTS,
            value: function (u, v) { return formatValue(v, unit); } };
        })
      ),
    };
  };

  Chart.prototype.update = function (payload, split) {
    this.payload = payload;
    var spec = null;
    (payload.charts || []).forEach(function (c) { if (c.id === this.id) { spec = c; } }, this);
    if (!spec) { return; }
    var lines = linesOf(spec, payload, split);
    var data = align(lines);
    var key = split + "|" + lines.map(function (l) { return l.label; }).join("|");
    if (this.plot && key === this.key) {
      this.plot.setData(data);  // rescales: x to the new window (see options), y to the new values
    } else {
      if (this.plot) { this.plot.destroy(); }
      this.plot = new window.uPlot(this.options(lines), data, this.holder);
      this.key = key;
    }
    this.registry[this.id] = this.plot;
    var filled = hasValues(data);
    var noGpu = Boolean(this.noGpu) && !filled;
    if (this.noGpu) { this.noGpu.hidden = !noGpu; }
    this.holder.hidden = noGpu;
    this.figure.classList.toggle("metrics-chart-no-gpu", noGpu);
    this.empty.hidden = filled || noGpu;
  };

  Chart.prototype.resize = function () {
    if (this.plot) { this.plot.setSize({ width: this.width(), height: HEIGHT }); }
  };

  function App(root) {
    this.root = root;
    this.url = root.getAttribute("data-url");
    this.refreshMs = Number(root.getAttribute("data-refresh-ms") || 5000);
    this.windowSelect = document.getElementById("metrics-window");
    this.splitSelect = document.getElementById("metrics-split");
    this.pauseButton = document.getElementById("metrics-pause");
    this.status = document.getElementById("metrics-status");
    this.replicas = document.getElementById("metrics-replicas");
    this.workersDrawn = document.getElementById("metrics-workers-drawn");
    this.eventsBody = document.querySelector("#metrics-events tbody");
    this.paused = false;
    this.timer = null;
    this.payload = null;
    this.refreshes = 0;
    window.metricsCharts = {};
    var registry = window.metricsCharts;
    this.charts = Array.prototype.map.call(root.querySelectorAll("figure[data-chart]"), function (figure) {
      return new Chart(figure, registry);
    });
    var self = this;
    this.windowSelect.addEventListener("change", function () { self.refresh(); });
    this.splitSelect.addEventListener("change", function () { self.render(); });
    this.pauseButton.addEventListener("click", function () {
      self.paused = !self.paused;
      self.pauseButton.textContent = self.paused ? "Resume" : "Pause";
      if (!self.paused) { self.refresh(); }
    });
    var resizeTimer = null;
    window.addEventListener("resize", function () {
      window.clearTimeout(resizeTimer);
      resizeTimer = window.setTimeout(function () { self.charts.forEach(function (c) { c.resize(); }); }, 100);
    });
    document.addEventListener("visibilitychange", function () { if (!document.hidden) { self.refresh(); } });
  }

  App.prototype.schedule = function () {
    var self = this;
    window.clearTimeout(this.timer);
    this.timer = window.setTimeout(function () { self.refresh(); }, this.refreshMs);
  };

  App.prototype.refresh = function () {
    var self = this;
    window.clearTimeout(this.timer);
    if (this.paused || document.hidden) { this.schedule(); return; }
    var url = this.url + "?minutes=" + encodeURIComponent(this.windowSelect.value);
    fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" }, cache: "no-store" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.json();
      })
      .then(function (payload) {
        self.payload = payload;
        self.render();
        self.refreshes += 1;
        self.root.setAttribute("data-refreshes", String(self.refreshes));
        self.status.className = "metrics-status";
        self.status.textContent = "updated " + formatTime(Date.now(), 0) + ", every " + self.refreshMs / 1000 + "s";
      })
      .catch(function (error) {
        self.status.className = "metrics-status error";
        self.status.textContent = "refresh failed (" + error.message + "), retrying";
      })
      .then(function () { self.schedule(); });
  };

  App.prototype.render = function () {
    var payload = this.payload;
    if (!payload) { return; }
    var split = this.splitSelect.value;
    this.charts.forEach(function (chart) { chart.update(payload, split); });
    var parts = [];
    var replicas = (payload.deployment && payload.deployment.replicas) || {};
    Object.keys(replicas).forEach(function (role) {
      var r = replicas[role];
      parts.push(role + ": " + r.desired + " desired [" + r.min + "–" + r.max + "]");
    });
    if (payload.deployment) { parts.push("status " + payload.deployment.status); }
    this.replicas.textContent = parts.join("  ·  ");
    // The server draws the most loaded workers only (inference.selectors.worker_series): say so.
    var drawn = (payload.workers || []).length;
    var total = payload.workers_total || drawn;
    this.workersDrawn.hidden = total <= drawn;
    this.workersDrawn.textContent = "Per-worker lines: the " + drawn + " most loaded of " + total +
      " workers (mean load over their latest 5 minutes); the per-role lines cover all of them.";
    var body = this.eventsBody;
    while (body.firstChild) { body.removeChild(body.firstChild); }
    var span = Date.parse(payload.now) - Date.parse(payload.since);
    (payload.events || []).slice().reverse().slice(0, 50).forEach(function (event) {
      var row = document.createElement("tr");
      if (event.refused) { row.className = "metrics-event-refused"; }
      [formatTime(event.t, span), event.role, event.from + " → " + event.to + (event.refused ? " refused" : ""),
        event.source, event.reason]
        .forEach(function (text) {
          var cell = document.createElement("td");
          cell.textContent = String(text);  // textContent: reasons are free text
          row.appendChild(cell);
        });
      body.appendChild(row);
    });
  };

  function start() {
    var root = document.getElementById("metrics-app");
    if (!root) { return; }
    if (typeof window.uPlot !== "function") {
      var status = document.getElementById("metrics-status");
      status.className = "metrics-status error";
      status.textContent = "the chart library (uPlot) did not load";
      return;
    }
    new App(root).refresh();
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
