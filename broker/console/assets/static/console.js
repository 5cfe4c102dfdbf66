// gpupool console: live updates over server-sent events, and countdowns.
// The server renders every piece of HTML (escaped there); this script only
// swaps pieces in by id.
(function () {
  "use strict";
  var body = document.body;
  var skew = Number(body.dataset.now || Date.now()) - Date.now();
  function now() { return Date.now() + skew; }

  function fmt(ms) {
    var s = Math.max(0, Math.round(ms / 1000));
    var h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    return (h ? h + "h" : "") + (h || m ? m + "m" : "") + r + "s";
  }
  function tick() {
    document.querySelectorAll("[data-deadline]").forEach(function (el) {
      var left = Number(el.dataset.deadline) - now();
      el.textContent = left > 0 ? "in " + fmt(left) : "now (passed)";
    });
    document.querySelectorAll("[data-since]").forEach(function (el) {
      el.textContent = fmt(now() - Number(el.dataset.since));
    });
  }
  setInterval(tick, 1000);
  tick();

  // A heatmap cell opens its GPU on the host page.
  document.addEventListener("click", function (e) {
    var cell = e.target.closest && e.target.closest(".cells > i[data-gpu]");
    if (!cell) { return; }
    location.href = "/hosts/" + cell.parentElement.dataset.host + "?gpu=" + cell.dataset.gpu;
  });

  var banner = document.getElementById("banner");
  function say(text) { if (banner) { banner.textContent = text; banner.hidden = !text; } }
  var dot = document.getElementById("livestate");
  function live(on) { if (dot) { dot.className = on ? "live-on" : "live-off"; } }

  var url = body.dataset.stream;
  if (!url || !window.EventSource) { return; }
  var es = new EventSource(url);
  es.addEventListener("open", function () { live(true); say(""); });
  es.addEventListener("parts", function (e) {
    live(true);
    var parts = JSON.parse(e.data);
    parts.forEach(function (p) {
      var el = document.getElementById(p.id);
      if (!el) { return; }
      if (p.id === "live") { el.innerHTML = p.html; return; }
      var t = document.createElement("template");
      t.innerHTML = p.html;
      el.replaceWith(t.content);
    });
    tick();
    body.dataset.updates = String(Number(body.dataset.updates || 0) + 1);
  });
  es.addEventListener("signout", function (e) {
    es.close(); live(false);
    say("Signed out: " + e.data);
    location.reload();
  });
  es.addEventListener("fail", function (e) { es.close(); live(false); say(e.data); });
  es.addEventListener("stale", function (e) { live(false); say(e.data); });
  es.addEventListener("error", function () { live(false); });
})();
