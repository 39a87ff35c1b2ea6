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
