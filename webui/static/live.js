// Live updates without any library: a job page follows its server-sent events; the jobs
// list polls the JSON API for rows that are still running.
(function () {
  function fmt(n) { return (n / 1e6).toFixed(1) + " MB"; }
  function pad(n) { return (n < 10 ? "0" : "") + n; }
  // Times come in UTC (<time datetime="ISO 8601">): shown in this browser's time zone.
  document.querySelectorAll("time[datetime]").forEach(function (el) {
    var d = new Date(el.getAttribute("datetime"));
    if (isNaN(d)) { return; }
    var off = -d.getTimezoneOffset(), sign = off >= 0 ? "+" : "-";
    el.title = el.textContent;
    el.textContent = d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + " UTC" + sign +
      pad(Math.floor(Math.abs(off) / 60)) + ":" + pad(Math.abs(off) % 60);
  });
  var live = document.getElementById("live");
  if (live && live.dataset.terminal !== "1" && window.EventSource) {
    var seen = parseInt(live.dataset.events, 10);
    var es = new EventSource(live.dataset.stream);
    es.onmessage = function (ev) {
      var d = JSON.parse(ev.data);
      var st = document.getElementById("job-state");
      st.textContent = d.state; st.className = "state " + d.state;
      var p = document.getElementById("job-progress");
      p.max = d.bytes_total || 1; p.value = d.bytes_done;
      document.getElementById("job-bytes").textContent = fmt(d.bytes_done) + " / " + fmt(d.bytes_total);
      if (d.events !== seen || d.terminal) { es.close(); window.location.reload(); }
    };
    // Refused (too many open streams: 429) or cut off for good: the page would stop
    // following the job without a word. Load it again a little later.
    es.onerror = function () {
      if (es.readyState === EventSource.CLOSED) { setTimeout(function () { window.location.reload(); }, 5000); }
    };
  }
  // A restore form checks its destination as it is typed, before it is submitted.
  var form = document.getElementById("restore-form");
  if (form && form.dataset.check) {
    var verdict = document.getElementById("restore-verdict"), timer = null;
    var check = function () {
      var dest = form.elements.dest.value.trim();
      if (!dest) { verdict.textContent = ""; return; }
      var q = "?dest=" + encodeURIComponent(dest) + (form.elements.overwrite.checked ? "&overwrite=1" : "") +
        (form.elements.host ? "&host=" + encodeURIComponent(form.elements.host.value) : "");
      fetch(form.dataset.check + q, {credentials: "same-origin"}).then(function (r) { return r.json(); })
        .then(function (d) {
          verdict.textContent = d.ok ? "restores to " + d.target : d.error;
          verdict.className = d.ok ? "note ok" : "flash error";
          form.querySelector("button[type=submit]").disabled = !d.ok;
        });
    };
    form.elements.dest.addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(check, 250); });
    form.elements.overwrite.addEventListener("change", check);
    if (form.elements.host) { form.elements.host.addEventListener("change", check); }
  }
  var rows = document.querySelectorAll("tr[data-live]");
  if (rows.length) {
    setInterval(function () {
      rows.forEach(function (row) {
        fetch("/api/jobs/" + row.dataset.job).then(function (r) { return r.json(); }).then(function (d) {
          var st = row.querySelector('[data-field="state"]');
          st.textContent = d.state; st.className = "state " + d.state;
          var p = row.querySelector('[data-field="progress"]');
          p.max = d.bytes_total || 1; p.value = d.bytes_done;
        });
      });
    }, 1000);
  }
})();
