"""T0: the bundled workflows' layout (devtools/workflow_layout.py) on graphs made here: a long chain is
folded into two bands where the straight one would be read too small, a short one is not, notes go
into free room off every link, nothing overlaps."""

from __future__ import annotations

import pytest
import workflow_layout as wl

pytestmark = pytest.mark.t0


def _workflow(count: int, *, notes: int = 0, size: tuple[int, int] = (300, 120)) -> dict:
    """A chain of ``count`` nodes (1 -> 2 -> ...), then ``notes`` MarkdownNotes."""
    nodes = [{"id": i, "type": "KSampler", "size": list(size), "pos": [0, 0]} for i in range(1, count + 1)]
    nodes += [{"id": count + i, "type": "MarkdownNote", "size": [100, 100], "pos": [0, 0]}
              for i in range(1, notes + 1)]
    links = [[i, i, 0, i + 1, 0, "LATENT"] for i in range(1, count)]
    return {"nodes": nodes, "links": links}


def _boxes(workflow: dict) -> dict:
    return {node["id"]: wl._box(node) for node in workflow["nodes"]}


def _links_back(workflow: dict) -> list[tuple[int, int]]:
    boxes = _boxes(workflow)
    return [(link[1], link[3]) for link in workflow["links"] if boxes[link[1]][2] > boxes[link[3]][0]]


def _assert_apart(workflow: dict) -> None:
    boxes = _boxes(workflow)
    close = [(a, b) for a in boxes for b in boxes if a < b and wl._near(boxes[a], boxes[b])]
    assert close == [], f"nodes closer than the gaps: {close}"


def test_a_short_chain_stays_straight():
    workflow = wl.layout(_workflow(4))
    assert _links_back(workflow) == []
    assert len({node["pos"][1] for node in workflow["nodes"]}) == 1, "a chain of equal nodes is one row"
    _assert_apart(workflow)


def test_a_long_chain_folds_into_two_bands_read_larger():
    straight = _workflow(10)
    wl._arrange(straight, None, None)
    assert wl.fit_score(straight) < wl.FOLD_BELOW
    workflow = wl.layout(_workflow(10))
    assert wl.fit_score(workflow) >= wl.FOLD_BELOW
    back = _links_back(workflow)
    assert len(back) == 1, f"one link turns back, from the first band to the second: {back}"
    boxes = _boxes(workflow)
    (origin, target), = back
    assert boxes[target][1] >= boxes[origin][3] + wl.BAND_GAP, "the second band lies below the first"
    _assert_apart(workflow)


def test_a_note_goes_into_free_room_off_every_link():
    bare = wl.layout(_workflow(5, size=(300, 300)))
    workflow = wl.layout(_workflow(5, notes=1, size=(300, 300)))
    note = next(node for node in workflow["nodes"] if node["type"] == "MarkdownNote")
    assert note["size"] == list(wl.NOTE_SIZE) and note["bgcolor"] == wl.NOTE_BACKGROUND
    _assert_apart(workflow)
    boxes = _boxes(workflow)
    segments = [wl._link_segment(*(next(n for n in workflow["nodes"] if n["id"] == i) for i in (o, t)))
                for _, o, _, t, *_ in workflow["links"]]
    assert not any(wl._crosses(boxes[note["id"]], segment) for segment in segments)
    # five 300-wide nodes leave room above or below them for the note, so the graph is no wider
    width = [wl._bounds(list(_boxes(w).values())) for w in (bare, workflow)]
    assert width[1][2] - width[1][0] == width[0][2] - width[0][0]
    assert min(box[0] for box in boxes.values()) == wl.ORIGIN[0]


def test_a_note_is_read_first_where_the_graph_still_fits():
    """Above and left of every node (the top node, left-most of the top ones) while Fit View stays at
    READ_FIRST_ZOOM or more, though the free room under a chain's short nodes, beside its tall last one,
    would grow the graph less (there Fit View would show it at 1.03 instead of 0.77)."""
    workflow = _workflow(4, notes=1)
    workflow["nodes"][3]["size"] = [300, 700]
    wl.layout(workflow)
    assert wl.note_read_first(workflow) and wl.fit_score(workflow) >= wl.READ_FIRST_ZOOM
    _assert_apart(workflow)


def test_a_cycle_is_refused():
    workflow = _workflow(3)
    workflow["links"].append([9, 3, 0, 1, 0, "LATENT"])
    with pytest.raises(ValueError, match="cycle through node"):
        wl.layout(workflow)
