"""The page scripts of the layout checks (tests/test_t3_frontend.py ``TestOnA1080pScreen``), which
devtools/frontend.py runs: where each node is, the smallest text, notes' contrast, a run's outputs.

Why a module of their own: they read the page two ways, as each node design draws it (frontend
1.58.1's Nodes 2.0 nodes are DOM elements, ``.lg-node[data-node-id]``; the classic design draws
nodes on the canvas, where only LiteGraph's numbers tell), which frontend.py's driving code need not
know. Each is a JavaScript function for ``page.evaluate``.
"""

from __future__ import annotations

__all__ = ["NODE_BOXES_JS", "NOTE_CONTRAST_JS", "RUN_PICTURE_JS", "SHOW_RUN_JS", "SMALLEST_TEXT_JS"]

# Each node's box on screen, in graph units (title bar included), keyed by node id. Nodes 2.0 draws a
# node as a DOM element (``.lg-node[data-node-id]``, sized by its content: taller than on the canvas);
# the classic design draws it on the canvas, where its ``boundingRect`` is what it covers.
NODE_BOXES_JS = """() => {
  const ds = app.canvas.ds, out = {};
  const elements = document.querySelectorAll('.lg-node[data-node-id]');
  if (elements.length) {
    const canvas = app.canvas.canvas.getBoundingClientRect();
    for (const el of elements) {
      const r = el.getBoundingClientRect(), x = (r.left - canvas.left) / ds.scale - ds.offset[0];
      const y = (r.top - canvas.top) / ds.scale - ds.offset[1];
      out[el.dataset.nodeId] = [x, y, x + r.width / ds.scale, y + r.height / ds.scale];
    }
    return out;
  }
  for (const node of app.graph.nodes) {
    const [x, y, w, h] = node.boundingRect; out[String(node.id)] = [x, y, x + w, y + h];
  }
  return out;
}"""
# The smallest text of the nodes as the screen shows it, in CSS pixels: DOM text (Nodes 2.0's nodes,
# the classic design's DOM widgets: text boxes, notes) at its font size times the zoom, and in the
# classic design the canvas' own title and widget text (LiteGraph's font sizes) times the zoom.
SMALLEST_TEXT_JS = """() => {
  const ds = app.canvas.ds, sizes = [];
  const vue = document.querySelectorAll('.lg-node[data-node-id]').length > 0;
  const roots = document.querySelectorAll(vue ? '.lg-node[data-node-id]' : '.dom-widget');
  const visible = (el) => !!(el.offsetWidth || el.offsetHeight);
  for (const root of roots) for (const el of [root, ...root.querySelectorAll('*')]) {
    const text = [...el.childNodes].some((c) => c.nodeType === 3 && c.textContent.trim())
      || ((el.tagName === 'TEXTAREA' || el.tagName === 'INPUT') && el.value);
    if (text && visible(el)) sizes.push(parseFloat(getComputedStyle(el).fontSize) * (vue ? ds.scale : 1));
  }
  if (!vue) {  // classic DOM widgets are scaled by a CSS transform, which computed font sizes leave out
    for (let i = 0; i < sizes.length; i++) sizes[i] = sizes[i] * ds.scale;
    sizes.push(LiteGraph.NODE_TEXT_SIZE * ds.scale, LiteGraph.NODE_SUBTEXT_SIZE * ds.scale);
  }
  return Math.min(...sizes);
}"""
# Notes' text against their background: WCAG contrast ratio of every visible text element of a Note or
# MarkdownNote, the background being the first opaque one behind it (the node's colour on the canvas
# in the classic design, where the DOM text box is transparent over it). Inline code is left out: it
# keeps the frontend's own colours on its own background whatever the note's (4.2 in 1.58.1's Nodes 2.0).
NOTE_CONTRAST_JS = """() => {
  const rgb = (css) => { const m = css.match(/[\\d.]+/g) || []; return m.map(Number); };
  const parse = (css) => {
    if (css.startsWith('#')) {
      const h = css.length === 4 ? [...css.slice(1)].map((c) => c + c).join('') : css.slice(1, 7);
      return [0, 2, 4].map((i) => parseInt(h.slice(i, i + 2), 16)).concat([1]);
    }
    const v = rgb(css); return v.length === 3 ? v.concat([1]) : v;
  };
  const lum = ([r, g, b]) => { const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92
    : ((c + 0.055) / 1.055) ** 2.4; }; return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
  const ratio = (a, b) => {
    const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const out = {};
  for (const node of app.graph.nodes) {
    if (node.type !== 'Note' && node.type !== 'MarkdownNote') continue;
    const vueRoot = document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
    const roots = vueRoot ? [vueRoot]
      : (node.widgets ?? []).map((w) => w.element).filter((el) => el);
    let worst = Infinity;
    for (const root of roots) for (const el of [root, ...root.querySelectorAll('*')]) {
      const text = [...el.childNodes].some((c) => c.nodeType === 3 && c.textContent.trim())
        || (el.tagName === 'TEXTAREA' && el.value);
      if (!text || !(el.offsetWidth || el.offsetHeight) || el.closest('code')) continue;
      let back = null;
      for (let up = el; up && !back; up = up.parentElement) {
        const c = parse(getComputedStyle(up).backgroundColor);
        if (c[3] >= 0.99) back = c;
        if (up === root) break;
      }
      back ??= parse(node.bgcolor ?? LiteGraph.NODE_DEFAULT_BGCOLOR);
      worst = Math.min(worst, ratio(parse(getComputedStyle(el).color), back));
    }
    out[String(node.id)] = worst;
  }
  return out;
}"""
# Uploads a 384x512 picture once (into the server's input folder) and returns its image reference: as
# tall for its width as the tallest a bundled workflow shows (the 3x3 Merge Grid's, 192x252) and larger
# than any. 1.58.1 grows a node the same for it as for a square one (to 300 tall, 332 in Nodes 2.0).
RUN_PICTURE_JS = """async () => {
  const c = document.createElement('canvas'); c.width = 384; c.height = 512;
  const g = c.getContext('2d'); g.fillStyle = '#4a8'; g.fillRect(0, 0, 384, 512);
  const blob = await new Promise((resolve) => c.toBlob(resolve, 'image/png'));
  const form = new FormData(); form.append('image', blob, 'patchbay-run-output.png');
  form.append('overwrite', 'true');
  const image = await (await fetch('api/upload/image', {method: 'POST', body: form})).json();
  return {filename: image.name, subfolder: image.subfolder ?? '', type: image.type ?? 'input'};
}"""
# What a run shows, as the server's "executed" messages bring it: each output node that saves or
# previews images shows a picture, every other output node a few lines of text (a report).
SHOW_RUN_JS = """([picture, lines]) => {
  const api = window.comfyAPI.api.api;
  for (const node of app.graph.nodes) {
    const definition = node.constructor.nodeData;
    if (!definition?.output_node) continue;
    const images = (definition.input_order?.required ?? []).includes('images');
    const output = images ? {images: [picture]} : {text: lines};
    const id = String(node.id);
    api.dispatchCustomEvent('executed', {node: id, display_node: id, output, prompt_id: 'patchbay'});
  }
}"""
