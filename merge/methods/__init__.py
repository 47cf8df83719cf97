"""The built-in merge methods, one module per family; importing this package registers them all.

Names, parameter names, defaults and formulas follow sd-mecha 1.1.8 so that recipes port and
deterministic methods give the same numbers (tests/test_t0_merge_vs_sdmecha_methods.py). Two read
other keys than the one they evaluate (``related=``, merge/registry.py): ``exchange_ema`` (ema.py) and
``balance_attention`` (attention.py). The methods
taken from mergekit (spherical.py, sparse.py, linear's ``linear`` and ``nearswap``) are re-implemented
from its formulas (tests/test_t0_merge_mergekit_methods.py).
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
