"""A small symmetric matrix with its eigenvalues clipped from above, in plain Python.

The step-time model (`admission.py`) clips its 3x3 covariance every step of a steady
one-sequence decode (one direction is never excited and keeps growing). numpy's
`eigh` on a 3x3 costs little by itself, but on the event loop, between a step's
result and the next step's submission, a LAPACK call beside the model's OpenMP
threads cost several times the whole rest of the step's output processing; cyclic
Jacobi rotations on a list of lists need no library and converge in a few sweeps.
"""

from __future__ import annotations

import math

# Rotations stop once the off-diagonal mass is this small against the whole matrix:
# what LAPACK's symmetric solvers reach (a few ulps of the norm).
_TOLERANCE = 1e-30
_MAX_SWEEPS = 30


def clip_eigenvalues(m: list[list[float]], cap: float) -> list[list[float]]:
    """`V · diag(min(λ, cap)) · Vᵀ` for the symmetric `m = V · diag(λ) · Vᵀ` (a new list)."""
    n = len(m)
    a = [list(row) for row in m]
    v = [[1.0 if i == j else 0.0 for j in range(n)] for i in range(n)]
    norm = sum(x * x for row in a for x in row)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    for _ in range(_MAX_SWEEPS):
        if sum(a[i][j] * a[i][j] for i, j in pairs) <= _TOLERANCE * norm:
            break
        for p, q in pairs:
            apq = a[p][q]
            if apq == 0.0:
                continue
            theta = (a[q][q] - a[p][p]) / (2.0 * apq)
            t = math.copysign(1.0, theta) / (abs(theta) + math.sqrt(theta * theta + 1.0))
            c = 1.0 / math.sqrt(t * t + 1.0)
            s = t * c
            for k in range(n):  # columns p and q of a·J
                akp, akq = a[k][p], a[k][q]
                a[k][p], a[k][q] = c * akp - s * akq, s * akp + c * akq
            for k in range(n):  # rows p and q of Jᵀ·(a·J)
                apk, aqk = a[p][k], a[q][k]
                a[p][k], a[q][k] = c * apk - s * aqk, s * apk + c * aqk
            a[p][q] = a[q][p] = 0.0
            for k in range(n):
                vkp, vkq = v[k][p], v[k][q]
                v[k][p], v[k][q] = c * vkp - s * vkq, s * vkp + c * vkq
    values = [min(a[i][i], cap) for i in range(n)]
    return [[sum(v[i][k] * values[k] * v[j][k] for k in range(n)) for j in range(n)]
            for i in range(n)]
