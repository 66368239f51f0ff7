"""Calibration metrics against hand-worked values and independent references (numpy, sklearn)."""
import warnings

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from car_jax.calibration import metrics, plots

# Sums run in float32 inside jit; references are float64. For B <= 4096 the float32 rounding
# of means of numbers in [0, 1] stays below 1e-6.
ATOL = 1e-6


def ref_ece(correct, q, n_bins=10):
    """Plain loop over explicit float32 edges: [e_k, e_k+1), q == 1 in the last bin."""
    q = np.asarray(q, np.float32)
    edges = [np.float32(k / n_bins) for k in range(n_bins + 1)]
    total, over, under = 0.0, 0.0, 0.0
    for k in range(n_bins):
        lo, hi = edges[k], edges[k + 1]
        members = [i for i in range(len(q))
                   if lo <= q[i] < hi or (k == n_bins - 1 and q[i] == hi)]
        if not members:
            continue
        conf = sum(float(q[i]) for i in members) / len(members)
        acc = sum(float(correct[i]) for i in members) / len(members)
        w = len(members) / len(q)
        total += w * abs(conf - acc)
        over += w * max(conf - acc, 0.0)
        under += w * max(acc - conf, 0.0)
    return total, over, under


def random_data(seed, n):
    """Half of q on the grid 0, 0.1, ..., 1.0 (bin edges and ties), half uniform."""
    rng = np.random.default_rng(seed)
    q = np.where(rng.random(n) < 0.5, rng.integers(0, 11, n) / 10, rng.random(n))
    correct = rng.random(n) < q ** 1.5  # over-confident on purpose
    return correct, q.astype(np.float32)


def test_hand_worked():
    q = [0.9, 0.9, 0.9, 0.9, 0.2, 0.2]
    c = [True, True, True, False, False, True]
    m = metrics.calibration(c, q)
    assert m["accuracy"] == pytest.approx(4 / 6)
    # bin 9: n 4, conf 0.9, acc 0.75 (gap +0.15); bin 2: n 2, conf 0.2, acc 0.5 (gap -0.3)
    assert m["ece"] == pytest.approx(4 / 6 * 0.15 + 2 / 6 * 0.3)  # 0.1 + 0.1
    assert m["overconfidence"] == pytest.approx(0.1)
    assert m["underconfidence"] == pytest.approx(0.1)
    assert m["mcip"] == pytest.approx((0.9 + 0.2) / 2)
    assert m["brier"] == pytest.approx((3 * 0.01 + 0.81 + 0.04 + 0.64) / 6)
    # pairs (pos, neg): 3 x (0.9, 0.9) tie 0.5; 3 x (0.9, 0.2) win; (0.2, 0.9) loss;
    # (0.2, 0.2) tie 0.5 -> (1.5 + 3 + 0 + 0.5) / 8
    assert m["auroc"] == pytest.approx(5 / 8)
    assert (m["n"], m["n_correct"]) == (6, 4)


def test_bin_edges_are_exact():
    f32 = np.float32
    q = np.array([0.0, f32(0.1), np.nextafter(f32(0.1), f32(0)), f32(0.3),
                  np.nextafter(f32(0.3), f32(0)), f32(0.7), np.nextafter(f32(0.7), f32(0)),
                  f32(0.95), np.nextafter(f32(1), f32(0)), 1.0], np.float32)
    assert np.asarray(metrics.bin_index(q)).tolist() == [0, 1, 0, 3, 2, 7, 6, 9, 9, 9]
    count, _, _ = metrics.bin_stats(np.ones(q.size, bool), q)
    assert np.asarray(count).tolist() == [2, 1, 1, 1, 0, 0, 1, 1, 0, 3]


@pytest.mark.parametrize("seed, n", [(0, 50), (1, 333), (2, 1000), (3, 1000), (4, 4096)])
def test_against_references(seed, n):
    c, q = random_data(seed, n)
    m = metrics.calibration(c, q)
    ece, over, under = ref_ece(c, q)
    q64 = q.astype(np.float64)
    assert m["ece"] == pytest.approx(ece, abs=ATOL)
    assert m["overconfidence"] == pytest.approx(over, abs=ATOL)
    assert m["underconfidence"] == pytest.approx(under, abs=ATOL)
    assert m["overconfidence"] + m["underconfidence"] == pytest.approx(m["ece"], abs=ATOL)
    assert m["auroc"] == pytest.approx(roc_auc_score(c, q64), abs=ATOL)
    assert m["accuracy"] == pytest.approx(c.mean(), abs=ATOL)
    assert m["mcip"] == pytest.approx(q64[~c].mean(), abs=ATOL)
    assert m["brier"] == pytest.approx(np.mean((q64 - c) ** 2), abs=ATOL)
    assert m["mean_confidence"] == pytest.approx(q64.mean(), abs=ATOL)


@pytest.mark.parametrize("n_bins", [5, 15])
def test_other_bin_counts(n_bins):
    c, q = random_data(7, 600)
    assert metrics.calibration(c, q, n_bins)["ece"] == pytest.approx(ref_ece(c, q, n_bins)[0],
                                                                     abs=ATOL)


def test_perfect_ranking_and_all_ties():
    q = np.array([0.1, 0.2, 0.8, 0.9], np.float32)
    assert metrics.calibration([False, False, True, True], q)["auroc"] == 1.0
    assert metrics.calibration([True, True, False, False], q)["auroc"] == 0.0
    assert metrics.calibration([True, False, True, False], np.full(4, 0.5))["auroc"] == 0.5
    # -0.0 and 0.0 are the same confidence: a tie, not a ranking (the sort keys use the bits)
    assert metrics.calibration([False, True], np.array([0.0, -0.0], np.float32))["auroc"] == 0.5


@pytest.mark.parametrize("correct", [[True, True, True], [False, False, False]])
def test_single_class_auroc_is_nan_with_warning(correct):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = metrics.calibration(correct, [0.2, 0.5, 0.9])
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert np.isnan(m["auroc"]) and any("AUROC" in s for s in messages)
    # all correct: no wrong prediction, so MCIP is undefined too
    assert np.isnan(m["mcip"]) == all(correct) == any("MCIP" in s for s in messages)
    assert not np.isnan(m["ece"])


def test_no_warning_with_both_classes():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics.calibration([True, False], [0.9, 0.1])


@pytest.mark.parametrize("c, q", [
    ([True], [1.2]), ([True], [-0.1]), ([True], [np.nan]), ([True, False], [0.5]), ([], []),
    ([[True]], [[0.5]]),
])
def test_bad_inputs_raise(c, q):
    with pytest.raises(ValueError):
        metrics.calibration(c, q)


def test_bootstrap_ci():
    c, q = random_data(5, 800)
    m = metrics.calibration(c, q)
    ci = metrics.bootstrap_ci(c, q, n_boot=300, seed=1)
    assert set(ci) == set(metrics.KEYS)
    for k, (lo, hi) in ci.items():
        assert lo < m[k] < hi, k
    # accuracy's interval against the normal approximation 2 * 1.96 * sqrt(p (1 - p) / B);
    # 30 % slack because percentiles from 300 resamples are themselves noisy (~10 %)
    p = c.mean()
    width = ci["accuracy"][1] - ci["accuracy"][0]
    assert width == pytest.approx(2 * 1.96 * np.sqrt(p * (1 - p) / c.size), rel=0.3)
    assert metrics.bootstrap_ci(c, q, n_boot=300, seed=1) == ci  # seeded


def test_reliability_diagram_png(tmp_path):
    c, q = random_data(6, 300)
    path = plots.reliability_diagram(c, q, tmp_path / "rel.png", title="test")
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "rel.png").stat().st_size > 5000
