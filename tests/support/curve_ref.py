"""An independent fit of the saturating curve tau(x) = a - b x^-c (the model of `eagle_lib.data_value.curve`):
scipy's bounded nonlinear least squares from several starts, continuous in c (the library searches a grid of c
with a closed-form (a, b) per c). Used as the reference of the curve tests."""

import numpy as np
from scipy.optimize import least_squares


def refit(x, y, cap: float, floor: float = 1.0, c_lo: float = 0.02, c_hi: float = 3.0):
    """(a, b, c, sse) minimising the squared residuals with floor <= a <= cap, b >= 0, c_lo <= c <= c_hi."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)

    def resid(t):
        return y - (t[0] - t[1] * np.power(x, -t[2]))

    best = None
    for c0 in (0.05, 0.2, 0.5, 1.0, 2.0):
        for a0 in (floor + 1e-3, (floor + cap) / 2, cap - 1e-3):
            r = least_squares(resid, [a0, 0.5, c0], bounds=([floor, 0.0, c_lo], [cap, np.inf, c_hi]),
                              xtol=1e-14, ftol=1e-14, gtol=1e-14)  # fmt: skip
            sse = float(r.fun @ r.fun)
            if best is None or sse < best[3]:
                best = (*map(float, r.x), sse)
    return best
