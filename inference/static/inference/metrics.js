/* Live metric charts of a deployment, drawn on <canvas> without any library.
 *
 * The page (templates/admin/inference/deployment/metrics.html) holds one canvas per metric
 * (data-field, data-unit). Every few seconds this fetches the JSON of
 * inference.actions.deployment_metric_series from the admin-only URL in #metrics-app[data-url]:
 *   {since, now, deployment: {replicas: {role: {desired, min, max}}, status},
 *    series: {role: {t: [epoch ms], <field>: [number|null]}}, events: [{t, role, from, to, source, reason}]}
 * and redraws: one line per role, scale events as dashed vertical lines, a hover read-out.
 */
(function () {
  "use strict";

  var COLOURS = { prefill: "#1565c0", decode: "#e65100" };
  var FALLBACK_COLOURS = ["#2e7d32", "#6a1b9a", "#00838f"];
  var EVENT_COLOUR = "#7b1fa2";
  var PAD = { left: 58, right: 10, top: 10, bottom: 22 };

  function pad2(n) { return (n < 10 ? "0" : "") + n; }

  function colourOf(role, index) {
    return COLOURS[role] || FALLBACK_COLOURS[index % FALLBACK_COLOURS.length];
  }

  /* Units counting whole things: their axis never gets fractional ticks ("1.50 workers"). */
  var COUNT_UNITS = { workers: true, requests: true };

  function formatValue(v, unit) {
    if (v === null || v === undefined || isNaN(v)) { return "–"; }
    if (v === 0) { return unit === "ratio" ? "0%" : "0"; }  // not "0.0 ms" / "0.0%"
    if (unit === "ratio") { return (v * 100).toFixed(Math.abs(v) < 0.1 ? 1 : 0) + "%"; }
    if (unit === "s") {
      if (Math.abs(v) < 1) { return (v * 1000).toFixed(Math.abs(v) < 0.01 ? 1 : 0) + " ms"; }
      return v.toFixed(2) + " s";
    }
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

  /* A step of 1, 2 or 5 times a power of ten giving about `ticks` intervals over `range`. */
  function niceStep(range, ticks) {
    var raw = range / ticks;
    var magnitude = Math.pow(10, Math.floor(Math.log(raw) / Math.LN10));
    var norm = raw / magnitude;
    var step = norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10;
    return step * magnitude;
  }

  function median(values) {
    if (!values.length) { return 0; }
    var sorted = values.slice().sort(function (a, b) { return a - b; });
    return sorted[Math.floor(sorted.length / 2)];
  }

  function Chart(canvas) {
    this.canvas = canvas;
    this.field = canvas.getAttribute("data-field");
    this.unit = canvas.getAttribute("data-unit");
    this.payload = null;
    this.hoverX = null;
    this.tooltip = document.createElement("div");
    this.tooltip.className = "metrics-tooltip";
    this.tooltip.style.display = "none";
    canvas.parentNode.appendChild(this.tooltip);
    var self = this;
    canvas.addEventListener("mousemove", function (event) {
      var rect = canvas.getBoundingClientRect();
      self.hoverX = event.clientX - rect.left;
      self.draw();
    });
    canvas.addEventListener("mouseleave", function () {
      self.hoverX = null;
      self.tooltip.style.display = "none";
      self.draw();
    });
  }

  Chart.prototype.update = function (payload) {
    this.payload = payload;
    this.draw();
  };

  Chart.prototype.draw = function () {
    var payload = this.payload;
    var canvas = this.canvas;
    if (!payload) { return; }
    var ratio = window.devicePixelRatio || 1;
    var width = canvas.clientWidth || 420;
    var height = canvas.clientHeight || 190;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    var ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px sans-serif";
    var style = window.getComputedStyle(canvas);
    var textColour = style.color || "#333";

    var x0 = Date.parse(payload.since);
    var x1 = Date.parse(payload.now);
    if (!(x1 > x0)) { x1 = x0 + 1000; }
    var plotW = width - PAD.left - PAD.right;
    var plotH = height - PAD.top - PAD.bottom;
    var field = this.field;
    var unit = this.unit;
    var roles = Object.keys(payload.series || {});

    var maxValue = 0;
    var any = false;
    roles.forEach(function (role) {
      (payload.series[role][field] || []).forEach(function (v) {
        if (v !== null && v !== undefined && !isNaN(v)) { any = true; if (v > maxValue) { maxValue = v; } }
      });
    });
    if (unit === "ratio") { maxValue = Math.max(maxValue, 1); }
    if (maxValue <= 0) { maxValue = 1; }
    var step = niceStep(maxValue, 4);
    if (COUNT_UNITS[unit]) { step = Math.max(step, 1); }
    var top = Math.ceil(maxValue / step) * step;

    function xOf(t) { return PAD.left + ((t - x0) / (x1 - x0)) * plotW; }
    function yOf(v) { return PAD.top + plotH - (v / top) * plotH; }

    // Grid and axes.
    ctx.strokeStyle = "rgba(128,128,128,0.25)";
    ctx.fillStyle = textColour;
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (var v = 0; v <= top + step / 2; v += step) {
      var y = Math.round(yOf(v)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(PAD.left, y);
      ctx.lineTo(PAD.left + plotW, y);
      ctx.stroke();
      ctx.fillText(formatValue(v, unit), PAD.left - 4, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    var span = x1 - x0;
    for (var i = 0; i <= 4; i += 1) {
      var t = x0 + (span * i) / 4;
      var label = formatTime(t, span);
      var x = xOf(t);
      if (i === 0) { ctx.textAlign = "left"; } else if (i === 4) { ctx.textAlign = "right"; } else { ctx.textAlign = "center"; }
      ctx.fillText(label, x, PAD.top + plotH + 5);
    }

    // Scale events: dashed vertical lines, then their labels.
    var eventXs = [];
    ctx.save();
    ctx.setLineDash([3, 3]);
    ctx.strokeStyle = EVENT_COLOUR;
    (payload.events || []).forEach(function (event) {
      if (event.t < x0 || event.t > x1) { return; }
      var ex = Math.round(xOf(event.t)) + 0.5;
      eventXs.push({ x: ex, text: event.role.charAt(0) + "→" + event.to });
      ctx.beginPath();
      ctx.moveTo(ex, PAD.top);
      ctx.lineTo(ex, PAD.top + plotH);
      ctx.stroke();
    });
    ctx.restore();

    // Event labels: the new count, with a halo of the chart's background, under the series (data is
    // never hidden); right of the marker, or left of it where the label would run off the canvas
    // (new events sit at the right edge).
    ctx.save();
    ctx.font = "11px sans-serif";
    ctx.textBaseline = "top";
    ctx.lineJoin = "round";
    ctx.lineWidth = 3;
    ctx.strokeStyle = window.getComputedStyle(canvas.parentNode).backgroundColor || "#fff";
    ctx.fillStyle = EVENT_COLOUR;
    eventXs.forEach(function (marker) {
      var fitsRight = marker.x + 3 + ctx.measureText(marker.text).width <= width;
      var tx = fitsRight ? marker.x + 3 : marker.x - 3;
      ctx.textAlign = fitsRight ? "left" : "right";
      ctx.strokeText(marker.text, tx, PAD.top + 1);
      ctx.fillText(marker.text, tx, PAD.top + 1);
    });
    ctx.restore();

    if (!any) {
      ctx.fillStyle = textColour;
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      ctx.fillText("no samples in this window", PAD.left + plotW / 2, PAD.top + plotH / 2);
    }

    // One line per role; a null value or a long silence (workers down) breaks the line.
    roles.forEach(function (role, index) {
      var series = payload.series[role];
      var times = series.t || [];
      var values = series[field] || [];
      var gaps = [];
      for (var k = 1; k < times.length; k += 1) { gaps.push(times[k] - times[k - 1]); }
      var maxGap = Math.max(3 * median(gaps), 15000);
      ctx.strokeStyle = colourOf(role, index);
      ctx.fillStyle = colourOf(role, index);
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      var drawing = false;
      var lastT = null;
      var points = 0;
      for (var j = 0; j < times.length; j += 1) {
        var value = values[j];
        if (value === null || value === undefined || isNaN(value)) { drawing = false; continue; }
        var px = xOf(times[j]);
        var py = yOf(value);
        if (drawing && lastT !== null && times[j] - lastT <= maxGap) {
          ctx.lineTo(px, py);
        } else {
          ctx.moveTo(px, py);
          ctx.fillRect(px - 1.5, py - 1.5, 3, 3);
        }
        drawing = true;
        lastT = times[j];
        points += 1;
      }
      if (points) { ctx.stroke(); }
    });

    this.drawHover(payload, roles, xOf, yOf, x0, x1, plotH);
  };

  Chart.prototype.drawHover = function (payload, roles, xOf, yOf, x0, x1, plotH) {
    var tooltip = this.tooltip;
    if (this.hoverX === null || this.hoverX < PAD.left) { tooltip.style.display = "none"; return; }
    var ctx = this.canvas.getContext("2d");
    var field = this.field;
    var unit = this.unit;
    var plotW = this.canvas.clientWidth - PAD.left - PAD.right;
    var t = x0 + ((this.hoverX - PAD.left) / plotW) * (x1 - x0);
    var lines = [formatTime(t, 0)];
    ctx.strokeStyle = "rgba(128,128,128,0.7)";
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(this.hoverX + 0.5, PAD.top);
    ctx.lineTo(this.hoverX + 0.5, PAD.top + plotH);
    ctx.stroke();
    roles.forEach(function (role, index) {
      var times = payload.series[role].t || [];
      var values = payload.series[role][field] || [];
      var best = -1;
      for (var k = 0; k < times.length; k += 1) {
        if (best < 0 || Math.abs(times[k] - t) < Math.abs(times[best] - t)) { best = k; }
      }
      if (best < 0) { return; }
      var value = values[best];
      if (value !== null && value !== undefined) {
        ctx.fillStyle = colourOf(role, index);
        ctx.beginPath();
        ctx.arc(xOf(times[best]), yOf(value), 3, 0, 2 * Math.PI);
        ctx.fill();
      }
      lines.push(role + ": " + formatValue(value, unit));
    });
    tooltip.textContent = lines.join("  ·  ");
    tooltip.style.display = "block";
    var left = Math.min(this.hoverX + 12, this.canvas.clientWidth - tooltip.offsetWidth);
    tooltip.style.left = Math.max(left, 0) + "px";
    tooltip.style.top = "30px";
  };

  function App(root) {
    this.root = root;
    this.url = root.getAttribute("data-url");
    this.refreshMs = Number(root.getAttribute("data-refresh-ms") || 5000);
    this.windowSelect = document.getElementById("metrics-window");
    this.pauseButton = document.getElementById("metrics-pause");
    this.status = document.getElementById("metrics-status");
    this.replicas = document.getElementById("metrics-replicas");
    this.eventsBody = document.querySelector("#metrics-events tbody");
    this.paused = false;
    this.timer = null;
    this.payload = null;
    this.charts = Array.prototype.map.call(root.querySelectorAll("canvas[data-field]"), function (canvas) {
      return new Chart(canvas);
    });
    var self = this;
    this.windowSelect.addEventListener("change", function () { self.refresh(); });
    this.pauseButton.addEventListener("click", function () {
      self.paused = !self.paused;
      self.pauseButton.textContent = self.paused ? "Resume" : "Pause";
      if (!self.paused) { self.refresh(); }
    });
    window.addEventListener("resize", function () { self.render(); });
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
    this.charts.forEach(function (chart) { chart.update(payload); });
    var parts = [];
    var replicas = (payload.deployment && payload.deployment.replicas) || {};
    Object.keys(replicas).forEach(function (role) {
      var r = replicas[role];
      parts.push(role + ": " + r.desired + " desired [" + r.min + "–" + r.max + "]");
    });
    if (payload.deployment) { parts.push("status " + payload.deployment.status); }
    this.replicas.textContent = parts.join("  ·  ");
    var body = this.eventsBody;
    while (body.firstChild) { body.removeChild(body.firstChild); }
    var span = Date.parse(payload.now) - Date.parse(payload.since);
    (payload.events || []).slice().reverse().slice(0, 50).forEach(function (event) {
      var row = document.createElement("tr");
      [formatTime(event.t, span), event.role, event.from + " → " + event.to, event.source, event.reason]
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
    if (root) { new App(root).refresh(); }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
