// idlegrid dashboard: charts (uPlot), chunked uploads, confirmations. No inline scripts:
// the pages' Content-Security-Policy allows scripts from this site only.
(function () {
  "use strict";

  var COLORS = ["#2f5bea", "#e8590c", "#12b886", "#ae3ec9"];

  function csrf() {
    var meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.content : "";
  }

  // Ticks with as many decimals as their step needs, so no two read the same
  // (uPlot's default rounds 0.0012 and 0.0014 both to "0.001").
  function tickLabels(u, splits, axis, space, step) {
    var decimals = 0;
    while (decimals < 12 && Math.abs(Math.round(step * Math.pow(10, decimals)) - step * Math.pow(10, decimals)) > 1e-9 * Math.pow(10, decimals)) decimals++;
    return splits.map(function (v) { return v == null ? "" : v.toLocaleString(undefined, { minimumFractionDigits: decimals, maximumFractionDigits: decimals }); });
  }

  window.idlegridCharts = { tickLabels: tickLabels };  // for the browser tests

  function drawCharts(root) {
    if (typeof uPlot === "undefined") return;
    (root || document).querySelectorAll(".chart-area[data-chart]").forEach(function (area) {
      var source = document.getElementById("chart-" + area.dataset.chart);
      if (!source) return;
      var data = JSON.parse(source.textContent);
      if (!data.x || data.x.length === 0) return;
      var series = JSON.parse(area.dataset.series);
      var kind = area.dataset.kind;
      var opts = {
        width: Math.max(area.clientWidth, 260),
        height: 220,
        scales: { x: { time: kind !== "rounds" } },
        legend: { show: series.length > 1 },
        axes: [{ stroke: "#5b6476" }, { stroke: "#5b6476", size: 60, values: tickLabels }],
        series: [{ label: kind === "rounds" ? "round" : "time" }],
      };
      if (data.range) opts.scales.x.range = data.range;
      var columns = [data.x];
      series.forEach(function (s, i) {
        var spec = { label: s.label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true };
        if (kind === "bars") {
          spec.fill = COLORS[i % COLORS.length] + "99";
          spec.paths = uPlot.paths.bars({ size: [0.7, 40] });
          spec.points = { show: false };
        }
        opts.series.push(spec);
        columns.push(data[s.key]);
      });
      area.textContent = "";
      var plot = new uPlot(opts, columns, area);
      if (window.ResizeObserver) {
        new ResizeObserver(function () {
          plot.setSize({ width: Math.max(area.clientWidth, 260), height: 220 });
        }).observe(area);
      }
    });
  }

  function request(method, url, body, type) {
    var headers = { "X-CSRF-Token": csrf() };
    if (type) headers["Content-Type"] = type;
    return fetch(url, { method: method, headers: headers, body: body, credentials: "same-origin" })
      .then(function (response) {
        if (response.status === 204) return {};
        return response.json().then(function (json) {
          if (!response.ok) throw new Error(json.message || "the upload failed (" + response.status + ")");
          return json;
        });
      });
  }

  function setupUpload() {
    var form = document.getElementById("upload-form");
    if (!form) return;
    var bar = form.querySelector("progress");
    var percent = document.getElementById("upload-percent");
    var box = document.getElementById("upload-progress");
    var error = document.getElementById("upload-error");
    var button = document.getElementById("upload-button");
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      var file = form.querySelector("#file").files[0];
      if (!file) return;
      error.hidden = true;
      if (file.size > Number(form.dataset.max)) {
        error.textContent = "This file is over the limit of one file.";
        error.hidden = false;
        return;
      }
      var purpose = form.querySelector("#purpose").value;
      var uploadId = null;
      button.disabled = true;
      box.hidden = false;
      request("POST", "/research/uploads", JSON.stringify({ name: file.name, purpose: purpose, size: file.size }), "application/json")
        .then(function (started) {
          uploadId = started.id;
          var chunk = started.chunk_size;
          function next(offset) {
            if (offset >= file.size) return request("POST", "/research/uploads/" + uploadId + "/finish");
            var slice = file.slice(offset, Math.min(offset + chunk, file.size));
            return request("PUT", "/research/uploads/" + uploadId + "?offset=" + offset, slice, "application/octet-stream")
              .then(function (done) {
                var value = Math.round((100 * done.received) / file.size);
                bar.value = value;
                percent.textContent = value + "%";
                return next(done.received);
              });
          }
          return next(0);
        })
        .then(function () { window.location.reload(); })
        .catch(function (failure) {
          error.textContent = failure.message;
          error.hidden = false;
          button.disabled = false;
          box.hidden = true;
          if (uploadId !== null) request("POST", "/research/uploads/" + uploadId + "/abort").catch(function () {});
        });
    });
  }

  function setupConfirms() {
    document.addEventListener("submit", function (event) {
      var message = event.target.dataset && event.target.dataset.confirm;
      if (message && !window.confirm(message)) event.preventDefault();
    }, true);
  }

  document.addEventListener("DOMContentLoaded", function () {
    drawCharts(document);
    setupUpload();
    setupConfirms();
  });
  document.addEventListener("htmx:afterSwap", function (event) { drawCharts(event.target); });
})();
