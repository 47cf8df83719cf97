// Save Merge, Extract LoRA from Merge and Clear Merge Cache (Patchbay): show the report each node returns
// (the file written and its size, warnings; what the cache freed) read-only in the node itself, as
// recipe_text.js does for Merge Recipe to Text: the frontend shows no `ui.text` on its own.
import { app } from "../../../scripts/app.js";  // served as /extensions/ComfyUI-Patchbay/js/

const NODES = {
  PatchbayMergeSave: "the saved file appears here when the node runs",
  PatchbayMergeExtractLora: "the extracted LoRA appears here when the node runs",
  PatchbayMergeCacheClear: "what the cache freed appears here when the node runs",
};
const WIDGET = "report";

app.registerExtension({
  name: "Patchbay.MergeReports",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    const placeholder = NODES[nodeData.name];
    if (placeholder === undefined) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      onNodeCreated?.apply(this, arguments);
      const area = document.createElement("textarea");
      area.readOnly = true;
      area.className = "comfy-multiline-input";
      area.placeholder = placeholder;
      this.addDOMWidget(WIDGET, "patchbay_merge_report", area, {
        getValue: () => area.value,
        setValue: (value) => { area.value = value ?? ""; },
        serialize: false,
      });
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const widget = this.widgets?.find((w) => w.name === WIDGET);
      if (widget) widget.value = (message?.text ?? []).join("\n");
    };
  },
});
