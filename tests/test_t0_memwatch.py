"""T0: devtools/memwatch.py attributes memory to a label file's first line (version and tier) and names the
tests that ran (the files' further lines) when the whole run peaked."""

from __future__ import annotations

import memwatch
import pytest

pytestmark = pytest.mark.t0

MB = memwatch.MB


def test_the_peak_names_the_tests_running_then_and_labels_stay_version_and_tier(tmp_path):
    folder = tmp_path / "labels"
    folder.mkdir()
    (folder / "0.3.75-t1").write_text("0.3.75 t1\ntests/test_t1_a.py::test_big")
    (folder / "0.33-t1").write_text("0.33.0 t1\ntests/test_t1_b.py::test_small")
    peaks = memwatch.Peaks()
    peaks.add({1: 5000 * MB, 2: 4000 * MB}, memwatch.current_labels(folder), 10.0)
    (folder / "0.3.75-t1").write_text("0.3.75 t1\ntests/test_t1_a.py::test_later")
    (folder / "0.33-t1").write_text("0.33.0 t2")  # a label without a test line
    peaks.add({1: 3000 * MB, 2: 1000 * MB}, memwatch.current_labels(folder), 20.0)
    found = peaks.as_json()
    assert found["labels_mb"] == {"0.3.75 t1": 9000, "0.33.0 t1": 9000, "0.33.0 t2": 4000}
    assert (found["peak_mb"], found["peak_at_s"]) == (9000, 10)
    assert found["peak_during"] == ["tests/test_t1_a.py::test_big", "tests/test_t1_b.py::test_small"]
    report = [{"version": "0.3.75", "tiers": {"t1": {"seconds": 5.0, "passed": 2}}}]
    text = memwatch.summary(found, report, 65)
    assert "0.3.75   t1          5     9000  2 passed" in text
    assert text.splitlines()[-1] == ("running at the peak: tests/test_t1_a.py::test_big; "
                                     "tests/test_t1_b.py::test_small")
