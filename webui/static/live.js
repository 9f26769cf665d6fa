// Live updates without any library: a job page follows its server-sent events (polling the
// JSON API, and saying so, while it cannot); the jobs list polls the JSON API for rows that
// are still running.
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
  if (live && live.dataset.terminal !== "1") {
    // Live through the job's event stream. A stream the server refuses (429: too many open
    // on this client or in all) or that drops is said plainly in the page, which then polls
    // the JSON API every N s and tries the stream again each time, until it is live again.
    var seen = parseInt(live.dataset.events, 10);
    var every = parseFloat(live.dataset.poll) || 5;
    var notice = document.getElementById("live-notice");
    var es = null, poller = null;
    var show = function (d) {
      var st = document.getElementById("job-state");
      st.textContent = d.state; st.className = "state " + d.state;
      var p = document.getElementById("job-progress");
      p.max = d.bytes_total || 1; p.value = d.bytes_done;
      document.getElementById("job-bytes").textContent = fmt(d.bytes_done) + " / " + fmt(d.bytes_total);
      var events = d.events !== undefined ? d.events : (d.timeline || []).length;
      var rests = d.resting !== undefined ? d.resting : d.terminal;  // the API's row, or the stream's
      if (events !== seen || rests) {
        if (es) { es.close(); }
        clearInterval(poller);
        window.location.reload();
      }
    };
    var poll = function () {
      fetch(live.dataset.api, {credentials: "same-origin"}).then(function (r) { return r.json(); }).then(show)
        .catch(function () {});
      if (!es) { connect(); }  // and try to be live again
    };
    var notLive = function (why) {
      notice.textContent = "not live (" + why + "): refreshing every " + every + " s";
      notice.hidden = false;
      if (!poller) { poller = setInterval(poll, every * 1000); }
    };
    var connect = function () {
      if (!window.EventSource) { notLive("this browser has no event streams"); return; }
      es = new EventSource(live.dataset.stream);
      es.onopen = function () {
        notice.hidden = true; notice.textContent = "";
        clearInterval(poller); poller = null;
      };
      es.onmessage = function (ev) { show(JSON.parse(ev.data)); };
      es.onerror = function () {
        var refused = es.readyState === EventSource.CLOSED;
        es.close(); es = null;  // retried by the poller, not by the browser's own fast loop
        notLive(refused ? "the server refused the live stream: too many open" : "the live stream dropped");
      };
    };
    connect();
  }
  // A list's bulk form: the header's checkbox checks or clears every row on the page.
  var all = document.getElementById("check-all");
  if (all) {
    all.addEventListener("change", function () {
      document.querySelectorAll('#bulk-form input[type=checkbox][name=id]').forEach(function (b) {
        b.checked = all.checked;
      });
    });
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
