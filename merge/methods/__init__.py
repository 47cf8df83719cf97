"""The built-in merge methods, one module per family; importing this package registers them all.

Names, parameter names, defaults and formulas follow sd-mecha 1.1.8 so that recipes port and
deterministic methods give the same numbers (tests/test_t0_merge_vs_sdmecha_methods.py).
"""

from . import cosine, crossover, dropout, limiting, linear, logistics, slicing, svd, ties  # noqa: F401
