// Live updates without any library: a job page follows its server-sent events; the jobs
// list polls the JSON API for rows that are still running.
(function () {
  function fmt(n) { return (n / 1e6).toFixed(1) + " MB"; }
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
