// Save Merge, Extract LoRA from Merge and Clear Merge Cache (Patchbay): show the report each node returns
// (the file written and its size, warnings; what the cache freed) read-only in the node itself, as
// recipe_text.js does for Merge Recipe to Text (both through text_report.js).
import { app } from "../../../scripts/app.js";  // served as /extensions/ComfyUI-Patchbay/js/
import { addTextReport } from "./text_report.js";

const NODES = {
  PatchbayMergeSave: "the saved file appears here when the node runs",
  PatchbayMergeExtractLora: "the extracted LoRA appears here when the node runs",
  PatchbayMergeCacheClear: "what the cache freed appears here when the node runs",
};

app.registerExtension({
  name: "Patchbay.MergeReports",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    const placeholder = NODES[nodeData.name];
    if (placeholder !== undefined) addTextReport(nodeType, "report", "patchbay_merge_report", placeholder);
  },
});
