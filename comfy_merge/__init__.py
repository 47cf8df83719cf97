"""ComfyUI adapters of the merge library: what the merge nodes (nodes/merge_*.py) call, so nodes/ holds
node classes only and merge/ imports no ComfyUI. Modules and data flow: docs/architecture.md (the
package table; One merge, end to end).
"""
