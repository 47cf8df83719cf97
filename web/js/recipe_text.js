// Merge Recipe to Text (Patchbay): show the recipe text the node returns, read-only, in the node itself
// (the way core's Preview Any shows its value).
import { app } from "../../../scripts/app.js";  // served as /extensions/ComfyUI-Patchbay/js/
import { addTextReport } from "./text_report.js";

app.registerExtension({
  name: "Patchbay.MergeRecipeToText",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "PatchbayMergeRecipeToText") return;
    addTextReport(nodeType, "recipe_text", "patchbay_recipe_text", "the recipe appears here when the node runs");
  },
});
