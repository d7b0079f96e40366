/* Live admin lists: reload the page every few seconds (data-interval-s on the script tag), except
 * while the user is working on it (a row selected, a field focused) or the tab is hidden, so the
 * reload never throws away a selection or typing. A small control in the header pauses it. */
(function () {
  "use strict";
  var script = document.currentScript;
  var intervalS = Number((script && script.getAttribute("data-interval-s")) || 10);
  var paused = false;
  var left = intervalS;

  function busy() {
    if (document.hidden) { return true; }
    var active = document.activeElement;
    if (active && /^(INPUT|SELECT|TEXTAREA)$/.test(active.tagName) && active.type !== "checkbox") { return true; }
    return document.querySelectorAll("#result_list input.action-select:checked").length > 0;
  }

  function start() {
    var tools = document.querySelector("#content-main") || document.body;
    var bar = document.createElement("p");
    bar.className = "help";
    var label = document.createElement("span");
    var button = document.createElement("a");
    button.href = "#";
    button.style.marginLeft = "0.5em";
    button.textContent = "pause";
    button.addEventListener("click", function (event) {
      event.preventDefault();
      paused = !paused;
      button.textContent = paused ? "resume" : "pause";
      left = intervalS;
      render();
    });
    bar.appendChild(label);
    bar.appendChild(button);
    tools.insertBefore(bar, tools.firstChild);

    function render() {
      label.textContent = paused ? "Auto-refresh paused." :
        (busy() ? "Auto-refresh waits while you work on the list." : "Refreshing in " + left + "s.");
    }

    window.setInterval(function () {
      if (!paused && !busy()) {
        left -= 1;
        if (left <= 0) { window.location.reload(); return; }
      } else if (!paused) {
        left = intervalS;
      }
      render();
    }, 1000);
    render();
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
