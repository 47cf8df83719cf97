// Merge Recipe to Text (Patchbay): show the recipe text the node returns, read-only, in the node itself
// (the way core's Preview Any shows its value).
import { app } from "../../../scripts/app.js";  // served as /extensions/ComfyUI-Patchbay/js/

const NODE = "PatchbayMergeRecipeToText";
const WIDGET = "recipe_text";

app.registerExtension({
  name: "Patchbay.MergeRecipeToText",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== NODE) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      onNodeCreated?.apply(this, arguments);
      const area = document.createElement("textarea");
      area.readOnly = true;
      area.className = "comfy-multiline-input";
      area.placeholder = "the recipe appears here when the node runs";
      this.addDOMWidget(WIDGET, "patchbay_recipe_text", area, {
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
