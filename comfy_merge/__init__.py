"""ComfyUI adapters of the merge library: what the merge nodes (nodes/merge_*.py) call, so nodes/ holds
node classes only and merge/ imports no ComfyUI. Imports merge/, hooks/, comfy and folder_paths; never
nodes/ (docs/architecture.md, One merge, end to end).

    files.py        paths a recipe names -> checked files inside ComfyUI's folders; the files the nodes
                    write; a file by name with a did-you-mean (shared with nodes/lora_files.py)
    graph_model.py  a graph MODEL -> a recipe leaf: merge/graph.py SourceNode holding a GraphModel, whose
                    open(space) gives a MemorySource with the model's patches applied key by key; compared
                    and cached by its fingerprint (the model and its patches_uuid), so an unchanged
                    upstream model keeps its cache entries across runs
    runtime.py      MergeRuntime with ComfyUI's interrupt, progress bar, the process-wide MergeCache and
                    the resolver (files.py; a graph:model-<token> path from a copied text is refused with
                    the fix); Merge (state dict streamed into the model ComfyUI's loader builds), Save
                    Merge, Extract LoRA, Merge LoRA Stack, Recipe Hook
"""
