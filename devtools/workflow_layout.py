"""Where each node of a bundled workflow goes: a layout that Fit View shows large on a 1080p screen.

Why: a workflow is read at the zoom Fit View picks when it is opened, and below zoom 0.6 the graph is
hard to read on 1920x1080 (tests/test_t3_frontend.py ``READABLE_ZOOM``). devtools/build_workflows.py
lays each workflow out here, from the UI-format nodes (and sizes) the frontend gave it, and loads the
result back; apart from the browser, so that T0 tests it (tests/test_t0_workflow_layout.py).

How: nodes go in dependency columns (longest path; sources next to their nearest consumer), each near
the mean height of its neighbours, none overlapping, spaced by their footprint in either node design
and after a run (devtools/node_footprints.py). A column taller than a cap may be split into side by
side sub-columns; of these candidates the one Fit View shows largest wins (``fit_score``). Where even
that would be read below ``FOLD_BELOW``, the chain is folded: its last columns go in a second band
below the first (the screen is 16:9, a chain of nine columns 4:1), aligned left or right (a short
tail, such as a decoder and its picture, turns down under the sampler). The links into the second band
are the only ones that run right to left, so the fold chosen is the one with the fewest and shortest
of them that reaches FOLD_BELOW. Notes (``NOTE_SIZE``) go last, into the free spot that enlarges the
graph least, off every link, the nearest the top left corner among those about as good.
"""

from __future__ import annotations

import copy
from typing import Any

from node_footprints import footprint

__all__ = ["FIT_CANVAS", "FOLD_BELOW", "NOTE_BACKGROUND", "NOTE_SIZE", "NOTE_TYPES", "fit_score", "layout"]

TITLE_HEIGHT = 30  # LiteGraph.NODE_TITLE_HEIGHT: drawn above a node's pos
GAP_X, GAP_Y, ORIGIN = 40, 40, (40.0, 60.0)
BAND_GAP = 80  # between the bands of a folded chain: room for the links that turn back
SLOT_HEIGHT = 20  # LiteGraph.NODE_SLOT_HEIGHT
LAYOUT_PASSES = 3
NOTE_TYPES = frozenset({"Note", "MarkdownNote"})
NOTE_SIZE = (480, 280)  # a few lines, readable at the zoom that fits the whole graph
# Darker than the notes' default (#653), on which Nodes 2.0's grey note text has a contrast of 2.8;
# here 5.4 (T3 asks for 4.5, WCAG AA). The title bar keeps the default #432.
NOTE_BACKGROUND = "#332922"
FIT_CANVAS = (1425, 755)  # graph units Fit View fills on 1920x1080 at zoom 1 (measured; it leaves margins)
COLUMN_CAPS = (None, 1400.0, 1100.0, 800.0, 600.0)
FOLD_BELOW = 0.6  # fold a chain only where the straight layout's fit_score is lower
FOLD_GAIN = 1.05  # and only where folding shows it at least this much larger
NOTE_SLACK = 0.01  # a note goes nearer the top left corner where that costs Fit View at most this much zoom
# A note is read first: it goes above and left of every node (first in reading order) unless every such
# spot would put Fit View below this zoom (READABLE_ZOOM 0.6 in tests/test_t3_frontend.py, with a margin)
READ_FIRST_ZOOM = 0.61
BACK_SPAN_STEP = 200  # links turning back count as equally long within this many graph units
TEXT_NODE_WIDTH = 400  # the width LiteGraph gives a node with a multiline text box
TEXT_NODE_SHRINK = (80, 50)  # prompts here are a line or two: a smaller box fits the graph at a larger zoom

Box = tuple[float, float, float, float]  # left, top, right, bottom (title bar included)
Edge = tuple[Any, int, Any, int]  # origin id, origin slot, target id, target slot


def layout(workflow: dict[str, Any]) -> dict[str, Any]:
    """Give every node of the UI-format ``workflow`` its ``pos`` (and notes and text boxes their size):
    the straight arrangement Fit View shows largest, or where that is read below FOLD_BELOW, among the
    folded ones that reach it the one with the fewest and shortest links turning back (else the
    largest, if FOLD_GAIN larger than the straight one), among the arrangements whose note is read first
    (above and left of every node) at READ_FIRST_ZOOM or more where there are any. Returns ``workflow``."""
    _size_nodes(workflow)
    straight: list[tuple[bool, float, dict[str, Any]]] = []
    folded: list[tuple[bool, bool, int, int, float, dict[str, Any]]] = []
    for cap in COLUMN_CAPS:
        for fold in _folds(workflow, cap):
            candidate = copy.deepcopy(workflow)
            _arrange(candidate, cap, fold)
            score = fit_score(candidate)
            first = score >= READ_FIRST_ZOOM and note_read_first(candidate)
            if fold is None:
                straight.append((first, score, candidate))
                continue
            back = _links_back(candidate)
            folded.append((first, score >= FOLD_BELOW, -len(back), -round(sum(back) / BACK_SPAN_STEP), score,
                           candidate))
    if any(entry[0] for entry in straight + folded):  # a note read first where it can be
        straight, folded = [e for e in straight if e[0]], [e for e in folded if e[0]]
    chosen = _choose(straight, folded)
    workflow["nodes"] = chosen["nodes"]
    return workflow


def _choose(straight: list[tuple], folded: list[tuple]) -> dict[str, Any]:
    """The straight arrangement Fit View shows largest, unless that is below FOLD_BELOW and a folded one
    reaches it (the one with the fewest and shortest links back) or is FOLD_GAIN larger."""
    best_straight = max(straight, key=lambda entry: entry[1], default=None)
    if best_straight is not None and (best_straight[1] >= FOLD_BELOW or not folded):
        return best_straight[2]
    best = max(folded, key=lambda entry: entry[1:5])
    if best_straight is None or best[1] or best[4] > best_straight[1] * FOLD_GAIN:
        return best[5]
    return best_straight[2]


def note_read_first(workflow: dict[str, Any]) -> bool:
    """Whether a note is what one reads first: the top node (left-most of the top ones) is a note."""
    top = min(workflow["nodes"], key=lambda node: (node["pos"][1], node["pos"][0]))
    return top["type"] in NOTE_TYPES


def _links_back(workflow: dict[str, Any]) -> list[float]:
    """How far each link that runs right to left (from one band to the next) runs back."""
    boxes = {node["id"]: _box(node) for node in workflow["nodes"]}
    spans = [boxes[origin][2] - boxes[target][0] for _, origin, _, target, *_ in workflow.get("links") or []]
    return [span for span in spans if span > 0]


def fit_score(workflow: dict[str, Any]) -> float:
    """The zoom at which the graph's bounding box before a run (footprints, title bars included) fits
    FIT_CANVAS: what Fit View shows when the workflow is opened."""
    boxes = [_box(node, after_run=False) for node in workflow["nodes"]]
    return _zoom(_bounds(boxes)) if boxes else 1.0


def _zoom(bounds: Box) -> float:
    return min(FIT_CANVAS[0] / (bounds[2] - bounds[0]), FIT_CANVAS[1] / (bounds[3] - bounds[1]))


def _box(node: dict[str, Any], *, after_run: bool = True) -> Box:
    (x, y), (w, h) = node["pos"], footprint(node, after_run=after_run)
    return x, y - TITLE_HEIGHT, x + w, y - TITLE_HEIGHT + h


def _bounds(boxes: list[Box]) -> Box:
    return (min(b[0] for b in boxes), min(b[1] for b in boxes),
            max(b[2] for b in boxes), max(b[3] for b in boxes))


def _size_nodes(workflow: dict[str, Any]) -> None:
    for node in workflow["nodes"]:
        if node["type"] in NOTE_TYPES:
            node["size"] = list(NOTE_SIZE)
            node["bgcolor"] = NOTE_BACKGROUND
        elif node["size"][0] == TEXT_NODE_WIDTH:
            node["size"] = [node["size"][0] - TEXT_NODE_SHRINK[0], node["size"][1] - TEXT_NODE_SHRINK[1]]


# -- columns and bands ---------------------------------------------------------------------------


def _link_ends(workflow: dict[str, Any]) -> list[Edge]:
    """(origin id, origin slot, target id, target slot) per link."""
    return [(link[1], link[2], link[3], link[4]) for link in workflow.get("links") or []]


def _columns(node_ids: list[Any], edges: list[Edge]) -> dict[Any, int]:
    """Longest-path layering; then sources move right, next to their nearest consumer."""
    origins = {nid: [o for o, _, t, _ in edges if t == nid] for nid in node_ids}
    column: dict[Any, int] = {}

    def depth(nid: Any, seen: frozenset = frozenset()) -> int:
        if nid not in column:
            if nid in seen:
                raise ValueError(f"the graph has a cycle through node {nid}")
            column[nid] = 1 + max((depth(o, seen | {nid}) for o in origins[nid]), default=-1)
        return column[nid]

    for nid in node_ids:
        depth(nid)
    for nid in node_ids:
        consumers = [column[t] for o, _, t, _ in edges if o == nid]
        if not origins[nid] and consumers:
            column[nid] = min(consumers) - 1
    return column


def _body(workflow: dict[str, Any], cap: float | None) -> tuple[dict[Any, dict], list[list[Any]]]:
    """The nodes other than notes by id, and their (sub-)columns left to right."""
    nodes = {node["id"]: node for node in workflow["nodes"] if node["type"] not in NOTE_TYPES}
    column = _columns(sorted(nodes), [e for e in _link_ends(workflow) if e[0] in nodes and e[2] in nodes])
    heights = {nid: footprint(node)[1] for nid, node in nodes.items()}  # either design, after a run too
    columns: list[list[Any]] = []
    for col in range(min(column.values(), default=0), max(column.values(), default=-1) + 1):
        columns += _split([nid for nid in sorted(nodes) if column[nid] == col], heights, cap)
    return nodes, [members for members in columns if members]


def _folds(workflow: dict[str, Any], cap: float | None) -> list[tuple[int, bool] | None]:
    """None (one band), then each column the second band may start at, the band aligned left or right
    (under the end of the first: a short tail turns back only a little way)."""
    count = len(_body(workflow, cap)[1])
    return [None, *((start, right) for start in range(1, count) for right in (False, True))]


def _split(members: list[Any], heights: dict[Any, float], cap: float | None) -> list[list[Any]]:
    """One column as sub-columns of at most ``cap`` stacked height each (in id order)."""
    if cap is None:
        return [members]
    out: list[list[Any]] = [[]]
    used = 0.0
    for nid in members:
        if out[-1] and used + heights[nid] > cap:
            out.append([])
            used = 0.0
        out[-1].append(nid)
        used += heights[nid] + GAP_Y
    return out


def _arrange(workflow: dict[str, Any], cap: float | None, fold: tuple[int, bool] | None) -> None:
    """Place the nodes in columns; with a ``fold`` (start, right) the columns from ``start`` on in a
    second band, aligned right with ``right``, just below the nodes of the first above it and those
    that feed it; then the notes; then move the whole graph to ORIGIN."""
    nodes, columns = _body(workflow, cap)
    edges = _link_ends(workflow)
    bands = [columns] if fold is None else [columns[:fold[0]], columns[fold[0]:]]
    above: dict[Any, Box] = {}  # the bands placed so far
    for band in bands:
        members = {nid for column in band for nid in column}
        right = max(box[2] for box in above.values()) if above and fold[1] else None
        xs = _band_xs(band, nodes, right)
        span = (min(xs.values()) - GAP_X, max(xs[nid] + footprint(nodes[nid])[0] for nid in members) + GAP_X)
        feeding = {o for o, _, t, _ in edges if t in members and o in above}
        top = max((box[3] + BAND_GAP for nid, box in above.items()
                   if (box[0] < span[1] and span[0] < box[2]) or nid in feeding), default=0.0)
        heights = {nid: footprint(nodes[nid])[1] for nid in members}
        ys = _heights_in_band(band, heights, [e for e in edges if e[0] in members and e[2] in members])
        lift = min(ys.values()) - (top + TITLE_HEIGHT)
        for nid in members:
            nodes[nid]["pos"] = [round(xs[nid]), round(ys[nid] - lift)]
        above.update({nid: _box(nodes[nid]) for nid in members})
    notes = sorted((node for node in workflow["nodes"] if node["type"] in NOTE_TYPES), key=lambda n: n["id"])
    _place_notes(notes, list(nodes.values()), edges)
    left, upper, _, _ = _bounds([_box(node) for node in workflow["nodes"]])
    for node in workflow["nodes"]:
        node["pos"] = [round(node["pos"][0] - left + ORIGIN[0]),
                       round(node["pos"][1] - upper + ORIGIN[1] - TITLE_HEIGHT)]


def _band_xs(band: list[list[Any]], nodes: dict[Any, dict], right: float | None) -> dict[Any, float]:
    """Each node's x: the columns side by side GAP_X apart, from ORIGIN or ending at ``right``."""
    xs, x = {}, ORIGIN[0]
    for column in band:
        xs.update({nid: x for nid in column})
        x += max(footprint(nodes[nid])[0] for nid in column) + GAP_X
    shift = 0.0 if right is None else right - (x - GAP_X)
    return {nid: value + shift for nid, value in xs.items()}


def _heights_in_band(band: list[list[Any]], heights: dict[Any, float], edges: list[Edge]) -> dict[Any, float]:
    """Each node's y: the columns stacked top-down, each node near its neighbours (the first pass by
    its inputs, later passes by its consumers as the pass before placed them too)."""
    ys: dict[Any, float] = {}
    for _ in range(LAYOUT_PASSES):
        previous, ys = ys, {}
        for members in band:
            _place_column(members, heights, edges, ys, previous)
    return ys


def _place_column(members: list[Any], heights: dict[Any, float], edges: list[Edge],
                  ys: dict[Any, float], previous: dict[Any, float]) -> None:
    """Stack one column top-down in node id order (the source's reading order), each node as near its
    wanted height as the node above allows."""
    def wanted(nid: Any) -> float:
        near = [ys[o] + SLOT_HEIGHT * os for o, os, t, _ in edges if t == nid and o in ys]
        near += [previous[t] + SLOT_HEIGHT * ts for o, _, t, ts in edges if o == nid and t in previous]
        return sum(near) / len(near) if near else float("inf")

    cursor = TITLE_HEIGHT
    for nid in sorted(members):
        want = wanted(nid)
        ys[nid] = cursor if want == float("inf") else max(want, cursor)
        cursor = ys[nid] + heights[nid] + GAP_Y


# -- notes ---------------------------------------------------------------------------------------


def _place_notes(notes: list[dict[str, Any]], placed: list[dict[str, Any]], edges: list[Edge]) -> None:
    """Each note in turn where the graph grows least (fit_score): in a free spot GAP_X / GAP_Y away
    from every node and crossing no link, or beside the graph, first in reading order (above and left of
    every node) where the graph still fits at READ_FIRST_ZOOM; the nearest the top left corner of those
    within NOTE_SLACK of the best."""
    by_id = {node["id"]: node for node in placed}
    segments = [_link_segment(by_id[o], by_id[t]) for o, _, t, _ in edges if o in by_id and t in by_id]
    for note in notes:
        boxes = [_box(node) for node in placed]
        width, height = footprint(note)
        if not boxes:
            note["pos"] = [ORIGIN[0], ORIGIN[1]]
            placed.append(note)
            continue
        left, upper, right, lower = _bounds(boxes)
        xs = {left, right - width, left - width - GAP_X, right + GAP_X} | {b[2] + GAP_X for b in boxes}
        ys = {upper, lower - height, upper - height - GAP_Y, lower + GAP_Y} | {b[3] + GAP_Y for b in boxes}
        spots = []
        for y in ys:
            for x in xs:
                spot = (x, y, x + width, y + height)
                free = not any(_near(spot, box) for box in boxes)
                if free and not any(_crosses(spot, segment) for segment in segments):
                    spots.append((_zoom(_bounds([*boxes, spot])), x, y))
        first = min((box[1], box[0]) for box in boxes)
        read_first = [spot for spot in spots if (spot[2], spot[1]) < first and spot[0] >= READ_FIRST_ZOOM]
        spots = read_first or spots
        best = max(score for score, _, _ in spots)
        good = [spot for spot in spots if spot[0] >= best - NOTE_SLACK]
        _, x, y = min(good, key=lambda spot: (spot[1] + spot[2], spot[2]))
        note["pos"] = [round(x), round(y + TITLE_HEIGHT)]
        placed.append(note)


def _near(a: Box, b: Box) -> bool:
    """``a`` comes closer to ``b`` than GAP_X / GAP_Y."""
    return a[0] < b[2] + GAP_X and b[0] < a[2] + GAP_X and a[1] < b[3] + GAP_Y and b[1] < a[3] + GAP_Y


def _link_segment(origin: dict[str, Any], target: dict[str, Any]) -> Box:
    """A link as the straight line from its origin's right side to its target's left side."""
    a, b = _box(origin), _box(target)
    return a[2], (a[1] + a[3]) / 2, b[0], (b[1] + b[3]) / 2


def _crosses(box: Box, segment: Box) -> bool:
    """The segment (x0, y0, x1, y1) passes through ``box`` (Liang-Barsky clipping)."""
    x0, y0, x1, y1 = segment
    dx, dy = x1 - x0, y1 - y0
    low, high = 0.0, 1.0
    for p, q in ((-dx, x0 - box[0]), (dx, box[2] - x0), (-dy, y0 - box[1]), (dy, box[3] - y0)):
        if p == 0:
            if q < 0:
                return False
            continue
        t = q / p
        if p < 0:
            low = max(low, t)
        else:
            high = min(high, t)
        if low > high:
            return False
    return True
