"""The step-time model's eigenvalue clip in plain Python against numpy's eigh."""

import numpy as np
import pytest

from app.engine.admission import P_MAX, StepTimeModel
from app.engine.eigen_clip import clip_eigenvalues


def _reference(m: np.ndarray, cap: float) -> np.ndarray:
    values, vectors = np.linalg.eigh(m)
    return vectors * np.minimum(values, cap) @ vectors.T


@pytest.mark.parametrize("seed", range(5))
def test_matches_eigh_on_spread_and_repeated_eigenvalues(seed):
    rng = np.random.default_rng(seed)
    for trial in range(200):
        q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        values = 10 ** rng.uniform(-12, 5, size=3)
        if trial % 3 == 0:
            values[1] = values[0]  # a repeated eigenvalue: any basis of its plane will do
        m = q * values @ q.T
        m = (m + m.T) / 2
        got = np.array(clip_eigenvalues(m.tolist(), P_MAX))
        ref = _reference(m, P_MAX)
        assert np.abs(got - ref).max() <= 1e-12 * max(1.0, np.abs(ref).max())


def test_diagonal_and_below_cap_are_kept():
    assert clip_eigenvalues([[5.0, 0.0], [0.0, 2e3]], 1e3) == [[5.0, 0.0], [0.0, 1e3]]
    m = [[2.0, 0.5, 0.1], [0.5, 1.0, 0.2], [0.1, 0.2, 3.0]]
    assert np.allclose(clip_eigenvalues(m, 1e3), m, rtol=0, atol=1e-14)


def test_one_sequence_decodes_keep_the_covariance_bounded():
    """Thousands of identical steps excite one direction only: the others grow by
    1/FORGET a step and must stay clipped at P_MAX, positive definite."""
    model = StepTimeModel(2048, 256)
    for _ in range(5000):
        model.observe(1, 1, 0.01)
    values = np.linalg.eigvalsh(np.array(model.p))
    assert values.max() <= P_MAX * (1 + 1e-9)
    assert values.min() > 0
    assert model.predict(1, 1) == pytest.approx(0.01, rel=1e-3)
