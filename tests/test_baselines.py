"""The count n-gram baselines: sparse Kneser–Ney of any order, and its score on the arms' windows."""

import math

import numpy as np
import pytest

from modbench.data import eval_windows
from modbench.errors import ModbenchError
from modbench.report.baselines import MAX_ORDER, KneserNey, fit_ngrams, sanity_baselines, window_bits_per_byte


def _bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8)


def test_unigram_bits_per_byte_equal_a_hand_computation():
    # train "aab": counts a=2, b=1; n1 = n2 = 1 so D = 1/(1 + 2) = 1/3; 3 tokens, 2 distinct bytes.
    d = 1 / 3
    p_a = (2 - d) / 3 + d * 2 / 3 / 256
    p_unseen = d * 2 / 3 / 256
    expected = -(math.log2(p_a) + math.log2(p_unseen)) / 2
    assert KneserNey(_bytes("aab"), 1).bits_per_byte(_bytes("ac")) == pytest.approx(expected, rel=1e-12)


def test_bigram_bits_per_byte_equal_a_hand_computation():
    # train "abab": bigrams ab ×2, ba ×1 → D₂ = 1/3; continuation counts N₁₊(•a) = N₁₊(•b) = 1 → D₁ = 1,
    # so the order-1 estimate is uniform: P₁ = 1/256 for every byte.
    # Scoring "ab": 'a' has no preceding byte (order 1 only); 'b' after 'a': (2 − 1/3)/2 + (1/3)·1/2·P₁(b).
    p1 = 1 / 256
    p_b = (2 - 1 / 3) / 2 + (1 / 3) * (1 / 2) * p1
    expected = -(math.log2(p1) + math.log2(p_b)) / 2
    assert KneserNey(_bytes("abab"), 2).bits_per_byte(_bytes("ab")) == pytest.approx(expected, rel=1e-12)


def _structured(n_groups: int, seed: int) -> np.ndarray:
    """Groups of four bytes: three random letters of a–d, then an upper-case letter fixed by all
    three (A + sum mod 4): only a context of three bytes predicts the fourth."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 4, (n_groups, 3))
    tail = head.sum(axis=1) % 4
    return np.concatenate([head + ord("a"), tail[:, None] + ord("A")], axis=1).astype(np.uint8).ravel()


def test_the_four_gram_sees_what_the_trigram_cannot():
    train, test = _structured(20_000, 0), _structured(2_000, 1)
    models = fit_ngrams(train)
    tri, four = models[3].bits_per_byte(test), models[4].bits_per_byte(test)
    # per group the trigram pays ~2 bits for the upper-case byte and the 4-gram ~0: ¼ · 2 = 0.5 bits/byte
    assert four < tri - 0.4
    b = sanity_baselines(train, test, "test", windows=(32, 50), models=models)
    assert b.window_fourgram < b.window_trigram - 0.4 and b.fourgram == pytest.approx(four)


@pytest.mark.parametrize("order", [4, 5])
def test_higher_orders_are_distributions_for_seen_and_unseen_contexts(order):
    rng = np.random.default_rng(7)
    model = KneserNey(rng.integers(97, 110, 20_000).astype(np.uint8), order)
    for context in ([97, 98, 99, 100], [200, 201, 202, 203], [97, 98, 99, 250]):
        probs = model.prob(np.array([context + [c] for c in range(256)], dtype=np.uint8))[:, -1]
        assert probs.min() > 0 and probs.sum() == pytest.approx(1.0, abs=1e-9)


def test_window_score_uses_exactly_the_arms_windows_and_no_byte_before_them():
    rng = np.random.default_rng(3)
    train = rng.integers(97, 105, 30_000).astype(np.uint8)
    split = rng.integers(97, 105, 5_000).astype(np.uint8)
    model = KneserNey(train, 4)
    seq_len, n_windows = 64, 20
    x, y = eval_windows(split, seq_len, n_windows)  # what every arm is scored on
    by_hand = []
    for xi, yi in zip(x.numpy(), y.numpy()):
        window = np.concatenate([xi, yi[-1:]])  # the window's bytes; its targets are window[1:] == yi
        assert (window[1:] == yi).all()
        by_hand.append(-np.log2(model.prob(window)[1:]))
    bpb, scored = window_bits_per_byte(model, split, seq_len, n_windows)
    assert scored == y.numel() and bpb == pytest.approx(float(np.mean(by_hand)), rel=1e-12)


def test_an_order_outside_the_supported_range_is_refused():
    with pytest.raises(ModbenchError, match=f"expected 1 to {MAX_ORDER}"):
        KneserNey(_bytes("abc" * 10), MAX_ORDER + 1)
