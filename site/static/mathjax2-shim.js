// @jupyter-widgets/base typesets a widget's text with MathJax 2's API,
// MathJax.Hub.Queue(["Typeset", MathJax.Hub, element]); the site loads MathJax 3, which has
// no Hub (the page then throws "Cannot read properties of undefined (reading 'Queue')").
// This gives MathJax 3 that one call. Loaded deferred, after MathJax's own deferred script;
// on a page without math there is no MathJax and nothing to do.
(function () {
  var mj = window.MathJax;
  if (!mj || mj.Hub) return;
  mj.Hub = {
    Queue: function (job) {
      var el = Array.isArray(job) ? job[2] : undefined;
      if (mj.typesetPromise) mj.typesetPromise(el ? [el] : undefined).catch(function () {});
    }
  };
})();
