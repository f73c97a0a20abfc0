// Inside the sandboxed report frame: tell the parent page we are ready, replace this
// document with the report HTML it sends (only the parent's message is accepted), then
// tell the parent how tall the report is so it can show it without a second scrollbar.
(function () {
  "use strict";
  window.addEventListener("message", function (event) {
    if (event.source !== window.parent || !event.data || event.data.kind !== "bnrecal-report") return;
    document.open();
    document.write(String(event.data.html));
    document.close();
    var height = document.documentElement.scrollHeight;
    window.parent.postMessage({ kind: "bnrecal-report-height", height: height }, "*");
  });
  window.parent.postMessage("bnrecal-report-frame-ready", "*");
})();
