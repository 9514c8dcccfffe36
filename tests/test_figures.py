"""The report's one figure module: every figure is a 200 dpi PNG with a PDF beside it, and each
draws what its claim compares (the claim's reference, per-seed points, the fit as a fit)."""

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from modbench.report import figures


def assert_200_dpi_with_pdf(png):
    with Image.open(png) as im:
        dpi = im.info.get("dpi")
    assert dpi is not None and dpi == pytest.approx((200, 200), abs=0.5), (png, dpi)
    pdf = png.with_suffix(".pdf")
    assert pdf.is_file() and pdf.read_bytes()[:5] == b"%PDF-", pdf


@pytest.fixture
def captured(monkeypatch):
    """The figures the module saves, for inspection of what was drawn."""
    saved = []
    real = figures.save_figure

    def keep(fig, png):
        saved.append(fig)
        return real(fig, png)

    monkeypatch.setattr(figures, "save_figure", keep)
    return saved


def _effects():
    return pd.DataFrame([
        dict(claim="C1", arm="sigmoid lr×2", reference="dense L3", estimate=-0.05, ci_low=-0.31, ci_high=0.21, margin=0.05),
        dict(claim="C1", arm="norm", reference="dense L3", estimate=0.11, ci_low=0.01, ci_high=0.2, margin=0.05),
        dict(claim="C2", arm="sigmoid", reference="random_gated", estimate=-0.014, ci_low=-0.037, ci_high=0.009, margin=None),
        dict(claim="C2", arm="norm", reference="random", estimate=0.01, ci_low=None, ci_high=None, margin=None)])


def _seeds():
    return pd.DataFrame([dict(claim="C1", arm="sigmoid lr×2", reference="dense L3", diff=d) for d in (-0.4, -0.02, 0.27)]
                        + [dict(claim="C2", arm="sigmoid", reference="random_gated", diff=d) for d in (-0.03, -0.01)])


def test_forest_plot_shows_every_ci_and_seed_inside_the_axes_with_true_minus_signs(tmp_path, captured):
    png = figures.forest_plot(_effects(), tmp_path / "effects.png", per_seed=_seeds(), margins={"C1": 0.05})
    assert_200_dpi_with_pdf(png)
    ax = captured[-1].axes[0]
    low, high = ax.get_xlim()
    assert low < -0.4 and high > 0.27  # the widest per-seed point and CI end are inside the axes: nothing clipped
    texts = [t.get_text() for t in ax.texts]
    assert "\u22120.050 [\u22120.310, +0.210]" in texts  # a negative estimate keeps its (true) minus sign
    assert "+0.010 (no CI)" in texts
    assert {"C1", "C2"} <= set(texts)  # each family labelled as its own block
    dots = [line for line in ax.lines if line.get_marker() == "o"]
    assert sum(len(line.get_xdata()) for line in dots) == 5  # every seed of every pair that has them
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["sigmoid lr×2 − dense L3", "norm − dense L3", "sigmoid − random_gated", "norm − random"]


def _curves():
    rows = []
    for arm, variant, cap, end in (("dense", "dense", 1.0, 3.0), ("dense L3", "dense", 1.0, 2.2),
                                   ("sigmoid", "sigmoid", 0.125, 2.4), ("random_gated", "random_gated", 0.125, 2.5)):
        for seed in (0, 1):
            for step in range(1, 5):
                rows.append(dict(arm=arm, variant=variant, capacity=cap, seed=seed, step=step, flops=1e9 * step,
                                 tokens=1e5 * step, val_bpb=end + 1.0 / step))
    return pd.DataFrame(rows)


def test_curves_draw_the_reference_they_are_given_and_otherwise_the_best_dense(tmp_path, captured):
    curves = _curves()
    assert figures.best_dense_arm(curves) == "dense L3"  # the strongest dense, not the first or the worst
    png = figures.small_multiples(curves, tmp_path / "curves.png")
    assert_200_dpi_with_pdf(png)
    for ax in captured[-1].axes:
        dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
        assert len(dashed) == 1 and dashed[0].get_label() == "reference: dense L3"
    figures.small_multiples(curves, tmp_path / "c2.png", reference="dense", reference_label="C1 reference: dense")
    assert all(any(line.get_label() == "C1 reference: dense" for line in ax.lines) for ax in captured[-1].axes)


def _profile(sizes=(1e4, 3e4, 1e5, 3e5)):
    rng = np.random.default_rng(0)
    rows = [dict(family="dense", budget=1e12, params=p, seed=s, loss=0.3 * (np.log10(p) - 4.8) ** 2 + 2 + rng.normal(0, 0.01))
            for p in sizes for s in (0, 1, 2)]
    return pd.DataFrame(rows)


@pytest.mark.parametrize("sizes,label", [((1e4, 3e4, 1e5, 3e5), "(1 residual df)"),
                                         ((1e4, 1e5, 1e6), "exact, 0 residual df, no CI")])
def test_isoflop_figure_labels_the_fit_with_its_df_and_shows_seeds_and_the_mod_arm(tmp_path, captured, sizes, label):
    from modbench.report.isoflop import profiles

    points = _profile(sizes)
    fits, _ = profiles(points, reference="dense")
    mod = pd.DataFrame([dict(arm="sigmoid C=0.125", variant="sigmoid", params=8e4, seed=s, loss=2.01 + 0.01 * s)
                        for s in (0, 1, 2)])
    others = points.assign(loss=points["loss"] + 0.1).iloc[:2]
    png = figures.isoflop_profile(points, fits, tmp_path / "isoflop.png", others=others, mod=mod)
    assert_200_dpi_with_pdf(png)
    ax = captured[-1].axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label in t and "fit" in t for t in legend), legend
    assert any(t == "sigmoid C=0.125 (MoD)" for t in legend)
    seed_dots = [line for line in ax.lines if line.get_marker() == "."]
    assert sum(len(line.get_xdata()) for line in seed_dots) == len(points)  # every seed, not only means


def test_isoflop_figure_of_a_single_dense_size_has_no_fit_and_draws(tmp_path, captured):
    """A study with one dense size at a FLOP budget (make quick) has no fit: the report passes an
    empty frame, and the figure still draws the size (it raised KeyError 'family')."""
    points = _profile((1e5,))
    png = figures.isoflop_profile(points, pd.DataFrame(), tmp_path / "isoflop.png")
    assert_200_dpi_with_pdf(png)
    legend = [t.get_text() for t in captured[-1].axes[0].get_legend().get_texts()]
    assert not any("fit" in t for t in legend) and any(t.startswith("dense at") for t in legend)


def test_every_diagnostic_figure_is_200_dpi_with_a_pdf(tmp_path):
    arms = pd.DataFrame(dict(arm=["dense", "sigmoid C=0.125", "sigmoid C=0.25"], variant=["dense", "sigmoid", "sigmoid"],
                             capacity=[1.0, 0.125, 0.25], mean=[2.5, 2.4, 2.45], ci_low=[2.4, 2.3, None],
                             ci_high=[2.6, 2.5, None], flops_per_token=[3e6, 2e6, 2.5e6], tokens_per_s=[1e4, 1.5e4, 1.2e4]))
    front = pd.Series([False, True, False])
    curves = _curves().rename(columns={"val_bpb": "val/bpb"})
    positions = pd.DataFrame([dict(arm="sigmoid", layer=0, bucket=b, rate=0.1 * b) for b in range(8)])
    masks = [np.arange(32) % 4 == 0, np.arange(32) < 8]
    for png in (figures.validation_curves(curves, tmp_path / "curves.png"),
                figures.pareto_scatter(arms, "flops_per_token", "FLOPs", front, tmp_path / "pareto.png"),
                figures.capacity_vs_bpb(arms, tmp_path / "capacity.png"),
                figures.throughput_bars(arms, tmp_path / "throughput.png"),
                figures.routing_by_position(positions, tmp_path / "positions.png"),
                figures.routing_heatmap(masks, tmp_path / "heatmap.png", title="sigmoid, seed 0")):
        assert_200_dpi_with_pdf(png)
