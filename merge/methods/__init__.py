"""The built-in merge methods, one module per family; importing this package declares them all. Names,
parameters and formulas follow sd-mecha 1.1.8 (tests/test_t0_merge_vs_sdmecha_methods.py); those
taken from mergekit are re-implemented from its formulas (tests/test_t0_merge_mergekit_methods.py).
"""

from . import (  # noqa: F401
    attention,
    cosine,
    crossover,
    dropout,
    ema,
    kronecker,
    limiting,
    linear,
    logistics,
    slicing,
    sparse,
    spherical,
    svd,
    ties,
)
