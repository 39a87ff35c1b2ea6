// Live refresh: re-fetch this page every few seconds and swap in its #live part, unless the
// person is typing in a form there (their input would be lost) or the page says it is final.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live || live.dataset.refresh === undefined) { return; }
  var seconds = parseFloat(live.dataset.refresh) || 3;
  function busy() {
    var active = document.activeElement;
    if (active && active.form && live.contains(active)) { return true; }
    // A pointer over a form: a refresh could move another effect's button under it.
    if (live.querySelector("form:hover")) { return true; }
    var fields = live.querySelectorAll("input[type=text], textarea");
    for (var i = 0; i < fields.length; i++) {
      if (fields[i].value !== fields[i].defaultValue) { return true; }
    }
    return false;
  }
  function refresh() {
    if (busy()) { setTimeout(refresh, seconds * 1000); return; }
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        // A failed fetch (the database away, a restart) keeps what is shown and tries again.
        if (!response.ok) { throw new Error("status " + response.status); }
        return response.text();
      })
      .then(function (text) {
        var fresh = new DOMParser().parseFromString(text, "text/html").getElementById("live");
        if (fresh) {
          live.innerHTML = fresh.innerHTML;
          document.getElementById("refreshed").textContent = new Date().toISOString();
          if (fresh.dataset.refresh === undefined) { delete live.dataset.refresh; return; }
        }
        setTimeout(refresh, seconds * 1000);
      })
      .catch(function () { setTimeout(refresh, seconds * 1000); });
  }
  setTimeout(refresh, seconds * 1000);
})();

// A form that says what it will do (cancelling a run) asks before it is sent.
document.addEventListener("submit", function (event) {
  "use strict";
  var message = event.target && event.target.dataset ? event.target.dataset.confirm : undefined;
  if (message && !window.confirm(message)) { event.preventDefault(); }
});

// Live output (docs/streaming.md): the run's output as server-sent events. Text is appended as
// it comes; a retraction strikes through what an attempt that lost the run had published (its
// fence, its positions) and says so; the browser resumes from the last position on its own.
(function () {
  "use strict";
  var output = document.getElementById("output");
  if (!output || !output.dataset.stream || !window.EventSource) { return; }
  var status = document.getElementById("output-status");
  var source = new EventSource(output.dataset.stream);
  var block = null;
  function piece(kind, event) {
    var data = JSON.parse(event.data);
    var element = document.createElement(kind === "text" ? "span" : "div");
    element.className = "output-" + kind;
    element.dataset.seq = data.seq;
    element.dataset.fence = data.fence;
    return { element: element, data: data };
  }
  source.addEventListener("text", function (event) {
    var made = piece("text", event);
    made.element.textContent = made.data.data.text;
    if (!block) { block = document.createElement("p"); block.className = "output-block"; output.appendChild(block); }
    block.appendChild(made.element);
  });
  source.addEventListener("progress", function (event) {
    var made = piece("progress", event);
    made.element.textContent = "• " + made.data.data.message;
    output.appendChild(made.element);
    block = null;
  });
  source.addEventListener("retracted", function (event) {
    var made = piece("retracted", event);
    var taken = made.data.data;
    var shown = output.querySelectorAll("[data-fence='" + taken.fence + "']");
    for (var i = 0; i < shown.length; i++) {
      var seq = parseInt(shown[i].dataset.seq, 10);
      if (seq >= taken.from_seq && seq <= taken.to_seq) { shown[i].classList.add("retracted"); }
    }
    made.element.textContent = "fence " + taken.fence + "'s unfinished output was retracted: " + taken.reason;
    output.appendChild(made.element);
    block = null;
  });
  source.addEventListener("truncated", function (event) {
    var made = piece("truncated", event);
    made.element.textContent = "the run's output reached its bound; the rest is not kept";
    output.appendChild(made.element);
    block = null;
  });
  source.addEventListener("open", function () { status.textContent = "live"; });
  source.addEventListener("end", function () {
    source.close();
    status.textContent = "the run has ended";
  });
  source.addEventListener("error", function () {
    if (source.readyState !== EventSource.CLOSED) { status.textContent = "reconnecting…"; }
  });
})();
