// Shared by recipe_text.js and merge_reports.js: a read-only text area in a node that shows the
// `ui.text` lines the node returned at its last run (the frontend shows no `ui.text` on its own).
// No extension is registered here; the two files that import it register theirs.

export function addTextReport(nodeType, widgetName, widgetType, placeholder) {
  const onNodeCreated = nodeType.prototype.onNodeCreated;
  nodeType.prototype.onNodeCreated = function () {
    onNodeCreated?.apply(this, arguments);
    const area = document.createElement("textarea");
    area.readOnly = true;
    area.className = "comfy-multiline-input";
    area.placeholder = placeholder;
    this.addDOMWidget(widgetName, widgetType, area, {
      getValue: () => area.value,
      setValue: (value) => { area.value = value ?? ""; },
      serialize: false,
    });
  };
  const onExecuted = nodeType.prototype.onExecuted;
  nodeType.prototype.onExecuted = function (message) {
    onExecuted?.apply(this, arguments);
    const widget = this.widgets?.find((w) => w.name === widgetName);
    if (widget) widget.value = (message?.text ?? []).join("\n");
  };
}
