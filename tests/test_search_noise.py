"""Evidence noise: drop / replace / shuffle at configured rates, seeded."""
import pytest

from car_jax.tools.corpus import Doc
from car_jax.tools.noise import NoiseConfig, NoisyRetriever
from car_jax.tools.retriever import Retriever

POOL = [Doc(str(i), f'"Doc {i}"\ntext {i}', None) for i in range(1000)]


class Fixed(Retriever):
    """Query "q<n>" -> docs n, n+1, ..., n+topk-1 with scores 1, 1/2, ..."""

    def _search(self, queries, topk):
        return [[Doc(POOL[int(q[1:]) + j].id, POOL[int(q[1:]) + j].contents, 1 / (j + 1))
                 for j in range(topk)] for q in queries]


QUERIES = [f"q{n}" for n in range(0, 400, 4)]  # 100 rows of 4 docs


def _ids(rows):
    return [[d.id for d in docs] for docs in rows]


def test_no_noise_is_identity():
    clean = Fixed().search(QUERIES, 4)
    assert _ids(NoisyRetriever(Fixed(), NoiseConfig()).search(QUERIES, 4)) == _ids(clean)
    assert not NoiseConfig().active and NoiseConfig(drop_rate=0.1).active


def test_drop_rate():
    assert all(docs == [] for docs in NoisyRetriever(Fixed(), NoiseConfig(drop_rate=1.0)).search(QUERIES, 4))
    kept = sum(map(len, NoisyRetriever(Fixed(), NoiseConfig(drop_rate=0.5, seed=1)).search(QUERIES, 4)))
    assert 120 < kept < 280  # 400 docs, each kept with p = 0.5


def test_replace_rate_uses_distractors_and_keeps_scores():
    clean = Fixed().search(QUERIES, 4)
    noisy = NoisyRetriever(Fixed(), NoiseConfig(replace_rate=1.0, seed=3), POOL).search(QUERIES, 4)
    for before, after in zip(clean, noisy):
        assert len(after) == 4
        assert [d.score for d in after] == [d.score for d in before]
        assert len({d.id for d in after}) == 4  # no duplicates within a row
        assert sum(d.id in {b.id for b in before} for d in after) <= 1  # almost all replaced
    with pytest.raises(ValueError, match="distractor pool"):
        NoisyRetriever(Fixed(), NoiseConfig(replace_rate=0.2))


def test_shuffle_rate_permutes_rows():
    clean = _ids(Fixed().search(QUERIES, 4))
    noisy = _ids(NoisyRetriever(Fixed(), NoiseConfig(shuffle_rate=1.0, seed=0)).search(QUERIES, 4))
    assert all(sorted(a) == sorted(b) for a, b in zip(clean, noisy))
    assert sum(a != b for a, b in zip(clean, noisy)) > 80  # 23/24 permutations differ


def test_seeded_and_reproducible():
    cfg = NoiseConfig(drop_rate=0.3, shuffle_rate=0.5, replace_rate=0.3, seed=7)
    a = _ids(NoisyRetriever(Fixed(), cfg, POOL).search(QUERIES, 4))
    b = _ids(NoisyRetriever(Fixed(), cfg, POOL).search(QUERIES, 4))
    c = _ids(NoisyRetriever(Fixed(), NoiseConfig(drop_rate=0.3, shuffle_rate=0.5, replace_rate=0.3, seed=8),
                            POOL).search(QUERIES, 4))
    assert a == b and a != c


@pytest.mark.parametrize("field", ["drop_rate", "shuffle_rate", "replace_rate"])
def test_rates_are_validated(field):
    with pytest.raises(ValueError, match=field):
        NoiseConfig(**{field: 1.5})
