"""Study controls, sub-grids and the claims report: sized by FLOPs, chosen on val, reported on test."""

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from modbench.cli.main import main
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.run import RunConfig, TrainConfig
from modbench.design.study_file import ClaimSettings, load_study
from modbench.errors import ModbenchError
from modbench.model.sizing import (MATCH_TOLERANCE, decode_flops_per_token, flops_per_token, iso_token_budget, matched_dense_shape)
from modbench.design.controls import control_arms, study_arms
from modbench.report import claims
from modbench.report.stats import holm
from scipy import stats
from modbench.run.train import train

FIXTURES = Path(__file__).resolve().parent / "fixtures"

TINY = RunConfig(ModelConfig(depth=3, n_embd=64, head_dim=8, max_seq_len=32), RoutingConfig("sigmoid", 0.25),
                 TrainConfig(dataset="arithmetic", seq_len=32, batch_size=4, budget="flops=2e9", track=False))

STUDY = """
[study]
name = "{name}"
seeds = [0, 1]
objectives = ["val/causal_bpb"]
controls = ["matched_dense", "iso_token_dense"]
claims = ["mod_vs_best_dense", "learned_vs_random", "causal_rule"]

[model]
depth = 3
n_embd = 64
head_dim = 8
max_seq_len = 32

[train]
dataset = "arithmetic"
seq_len = 32
batch_size = 4
budget = "flops=2e9"
eval_every = 5
eval_windows = 8
log_every = 5

[space]
variant = ["dense", "sigmoid", "random_gated"]
capacity = [0.25]

[[space.also]]
variant = ["dense"]
depth = [1, 2]

[[space.also]]
variant = ["sigmoid"]
lr_mult = [2.0]
"""


def write(tmp: Path, name: str = "claims", text: str = STUDY) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(text.format(name=name))
    return path


# --- sizing the controls --------------------------------------------------------------------
def test_matched_dense_is_within_tolerance_no_larger_and_its_ratio_is_exact():
    depth, width, ratio = matched_dense_shape(TINY)
    assert depth <= TINY.model.layers and width <= TINY.model.width and width % TINY.model.head_dim == 0
    routed = flops_per_token(TINY.model, TINY.routing, 32)
    dense = flops_per_token(ModelConfig(depth=depth, n_embd=width, n_head=width // 8, head_dim=8, max_seq_len=32),
                            RoutingConfig(), 32)
    assert ratio == pytest.approx(dense / routed) and abs(ratio - 1) <= MATCH_TOLERANCE
    assert dense < flops_per_token(TINY.model, RoutingConfig(), 32)  # cheaper than the routed model's own dense shape


def test_unmatchable_shape_is_a_one_line_error():
    with pytest.raises(ModbenchError, match="within 0%.*the closest, 3 layers × d=56, is off by"):
        matched_dense_shape(TINY, tolerance=1e-6)


def test_finer_widths_only_when_the_head_dimension_cannot_match():
    cfg = RunConfig(ModelConfig(depth=4, n_embd=128, head_dim=32, max_seq_len=128), RoutingConfig("sigmoid", 0.25),
                    TrainConfig(dataset="arithmetic", seq_len=128, budget="flops=1e13"))
    depth, width, ratio = matched_dense_shape(cfg)  # no multiple of 32 is within 3 %: an even width is
    assert width % 32 and width % 2 == 0 and abs(ratio - 1) <= MATCH_TOLERANCE
    assert matched_dense_shape(replace(cfg, routing=RoutingConfig("sigmoid", 0.125)))[:2] == (4, 96)


def test_iso_token_budget_is_the_routed_runs_own_length(tmp_cwd):
    budget = iso_token_budget(TINY)
    result = train(TINY)  # the routed run under its FLOP budget
    assert budget == f"steps={result.steps}"


def test_decode_flops_grow_with_the_realised_fraction():
    low, high = (decode_flops_per_token(TINY.model, TINY.routing, 32, f) for f in (0.1, 0.6))
    dense = flops_per_token(TINY.model, RoutingConfig(), 32) / 3  # forward = a third of training
    assert low < high < dense
    assert decode_flops_per_token(TINY.model, TINY.routing, 32, 1.0) == pytest.approx(dense)


def test_study_arms_union_the_grids_and_add_the_derived_controls(tmp_path):
    s = load_study(write(tmp_path))
    labels = [s.label(a) for a in study_arms(s)]
    assert labels[:3] == ["dense", "sigmoid C=0.25 alternate", "random_gated C=0.25 alternate"]
    assert {"dense L1", "dense L2", "sigmoid C=0.25 alternate lr×2"} <= set(labels)
    controls = control_arms(s)
    assert [a.control for a in controls] == ["FLOP-matched to C=0.25 alternate", "iso-tokens of C=0.25 alternate"]
    assert controls[0].width == 56 and controls[1].budget.startswith("steps=")
    assert len(labels) == len(set(labels)) == 8  # one shape's controls serve both routed variants


@pytest.mark.parametrize("edit, message", [
    ('controls = ["matched_dense", "iso_token_dense"]', None),
    ('controls = ["matched"]', "study.controls"),
    ('claims = ["mod_vs_best_dense", "learned_vs_random", "causal_rule"]\nsampler = "tpe"', None),
])
def test_controls_and_claims_are_validated(tmp_path, edit, message):
    text = STUDY.replace('controls = ["matched_dense", "iso_token_dense"]', edit)
    if message is None and "tpe" in edit:
        with pytest.raises(ModbenchError, match="need sampler = \"grid\""):
            load_study(write(tmp_path, text=text.replace('claims = ["mod_vs_best_dense", "learned_vs_random", "causal_rule"]\n', "", 1)))
    elif message:
        with pytest.raises(ModbenchError, match=message):
            load_study(write(tmp_path, text=text))
    else:
        load_study(write(tmp_path, text=text))


def test_space_also_rejects_unknown_keys(tmp_path):
    with pytest.raises(ModbenchError, match=r"space\.also\[0\]\.depht: unknown key"):
        load_study(write(tmp_path, text=STUDY.replace("depth = [1, 2]", "depht = [1, 2]")))


# --- the claims, on frames with planted answers -----------------------------------------------
def frame(rows: list[tuple], seeds=(0, 1, 2, 3)) -> pd.DataFrame:
    """rows: (arm, variant, control, lr_mult, val, test) → one row per seed, test + small seed noise."""
    out = []
    rng = np.random.default_rng(1)
    for arm, variant, control, lr, val, test in rows:
        for s in seeds:
            noise = 0.01 * (s - 1.5) + rng.normal(0, 0.002)  # shared by seed, plus a little of the arm's own
            out.append({"arm": arm, "variant": variant, "control": control, "lr_mult": lr, "capacity": 0.25,
                        "pattern": "alternate", "seed": s, "val/causal_bpb": val + noise, "test/causal_bpb": test + noise})
    return pd.DataFrame(out)


def test_best_dense_is_chosen_on_validation_and_reported_on_test():
    df = frame([("dense L2", "dense", "", 1.0, 2.50, 2.60),  # best on val, worse on test
                ("dense L4", "dense", "", 1.0, 2.55, 2.40),
                ("sigmoid", "sigmoid", "", 1.0, 2.45, 2.50)])
    found, eff = claims.mod_vs_best_dense(df)
    assert eff.iloc[0]["reference"] == "dense L2"
    test = df.groupby("arm")["test/causal_bpb"].mean()
    assert found[0].estimate == pytest.approx(test["sigmoid"] - test["dense L2"])  # on test, paired by seed
    assert found[0].estimate == pytest.approx(2.50 - 2.60, abs=0.005)
    assert found[0].verdict.startswith("supported")


def test_controls_join_the_c1_family_and_a_null_effect_is_not_supported():
    df = frame([("dense", "dense", "", 1.0, 2.5, 2.5), ("sigmoid", "sigmoid", "", 1.0, 2.5, 2.5),
                ("dense d56", "dense", "FLOP-matched", 1.0, 2.5, 2.5)])
    rng = np.random.default_rng(0)
    df["test/causal_bpb"] += rng.normal(0, 0.05, len(df))  # independent noise: no paired structure to exploit
    found, eff = claims.mod_vs_best_dense(df)
    assert list(eff["reference"]) == ["dense", "dense d56"] and (eff["correction"] == "holm").all()
    assert found[0].verdict.startswith("not supported") and found[0].ci_low < 0 < found[0].ci_high


def test_a_better_dense_control_at_the_same_budget_is_c1s_reference_and_other_budgets_never_are():
    """The isoFLOP-optimal dense model is the best dense size trained at the study's budget: a
    FLOP- or param-matched control (another size, same budget) better on val becomes C1's
    reference (and is not compared a second time); the iso-token and positive controls (other
    budgets) never do."""
    rows = [("dense", "dense", "", 1.0, 2.60, 2.60), ("sigmoid", "sigmoid", "", 1.0, 2.50, 2.50),
            ("dense L3 (param-matched)", "dense", "param-matched to L5 middle_cycle N_R=3", 1.0, 2.40, 2.40),
            ("dense L4 (FLOP-matched)", "dense", "FLOP-matched to C=0.125 alternate", 1.0, 2.45, 2.45),
            ("dense iso-tokens", "dense", "iso-tokens of C=0.125 alternate", 1.0, 2.20, 2.20),
            ("dense (positive control)", "dense", "positive control: dense at flops=5e12", 1.0, 2.10, 2.10)]
    found, eff = claims.mod_vs_best_dense(frame(rows))
    assert eff.iloc[0]["reference"] == "dense L3 (param-matched)" and eff.iloc[0]["family"] == "primary"
    assert "(dense L3 (param-matched), best size and LR on val)" in found[0].statement
    c1 = eff[eff["arm"] == "sigmoid"]  # (the positive control's C1+ row is its own)
    assert list(c1["reference"]).count("dense L3 (param-matched)") == 1
    assert {"dense L4 (FLOP-matched)", "dense iso-tokens"} <= set(c1["reference"])  # still secondary rows
    assert found[0].verdict_class == "worse"  # sigmoid 2.50 vs the best dense size 2.40


def test_learned_is_compared_with_its_own_random_control():
    df = frame([("sigmoid", "sigmoid", "", 1.0, 2.4, 2.4), ("random_gated", "random_gated", "", 1.0, 2.6, 2.6),
                ("norm", "norm", "", 1.0, 2.5, 2.7), ("random", "random", "", 1.0, 2.5, 2.5)])
    found, eff = claims.learned_vs_random(df)
    assert list(zip(eff["arm"], eff["reference"])) == [("sigmoid", "random_gated"), ("norm", "random")]
    assert found[0].verdict.startswith("supported") and "random better" in found[0].detail


def test_each_method_is_compared_with_sigmoid_the_first_as_the_primary_contrast():
    """C4: every other learned variant against sigmoid at the same capacity, pattern and LR; the
    controls and dense are not methods; the estimate is the paired test difference. The first
    method is the primary contrast (its own family), the others one Holm family."""
    df = frame([("sigmoid", "sigmoid", "", 1.0, 2.40, 2.40), ("token_choice", "token_choice", "", 1.0, 2.50, 2.50),
                ("mode_staged", "mode_staged", "", 1.0, 2.40, 2.40), ("random_gated", "random_gated", "", 1.0, 2.6, 2.6),
                ("dense", "dense", "", 1.0, 2.7, 2.7), ("sigmoid x2", "sigmoid", "", 2.0, 2.3, 2.3)])
    found, eff = claims.methods_vs_sigmoid(df)
    assert list(zip(eff["arm"], eff["reference"])) == [("token_choice", "sigmoid"), ("mode_staged", "sigmoid")]
    assert [c.id for c in found] == ["C4a", "C4b"] and (eff["correction"] == "holm").all()
    assert [c.primary for c in found] == [True, False] and list(eff["family"]) == ["primary", "secondary"]
    test = df.groupby("arm")["test/causal_bpb"].mean()
    assert found[0].estimate == pytest.approx(test["token_choice"] - test["sigmoid"])
    assert found[0].verdict.startswith("reversed: sigmoid is better")
    assert not found[1].verdict.startswith(("supported", "reversed"))  # equal means: no verdict either way
    assert [claims._letters(i) for i in (0, 25, 26, 27)] == ["a", "z", "aa", "ab"]
    assert "causal − top-k gap: n/a" in found[0].statement  # no top-k validation bpb in this frame


def test_each_methods_causal_gap_is_stated_beside_sigmoids_in_its_claim():
    """Issue 26: each method's causal − top-k gap (val causal − val top-k bpb, mean and t CI over the
    compared seeds) in the claims table, beside the reference's."""
    df = frame([("sigmoid", "sigmoid", "", 1.0, 2.40, 2.40), ("amod", "amod", "", 1.0, 2.45, 2.45)])
    gaps = {"sigmoid": [0.010, 0.020, 0.015, 0.015], "amod": [0.070, 0.080, 0.075, 0.071]}
    df["val/bpb"] = df["val/causal_bpb"] - [gaps[a][s] for a, s in zip(df["arm"], df["seed"])]
    found, _ = claims.methods_vs_sigmoid(df)
    amod = np.array(gaps["amod"])
    low, high = stats.t.interval(0.95, 3, loc=amod.mean(), scale=stats.sem(amod))
    assert f"method {amod.mean():+.3f} [{low:+.3f}, {high:+.3f}]; reference +0.015 [" in found[0].statement


def test_primary_contrast_is_its_own_family_and_secondary_rows_are_holm_corrected_apart():
    df = frame([("dense", "dense", "", 1.0, 2.5, 2.50), ("sigmoid", "sigmoid", "", 1.0, 2.4, 2.49),
                ("norm", "norm", "", 1.0, 2.45, 2.49), ("dense d56", "dense", "FLOP-matched", 1.0, 2.6, 2.49)])
    rng = np.random.default_rng(2)
    df["test/causal_bpb"] += rng.normal(0, 0.01, len(df))
    found, eff = claims.mod_vs_best_dense(df, ClaimSettings(primary="norm"))
    primary = eff[eff["family"] == "primary"]
    assert list(primary["arm"]) == ["norm"] and primary["p_adj"].iloc[0] == pytest.approx(primary["p"].iloc[0])
    secondary = eff[eff["family"] == "secondary"]
    assert list(zip(secondary["arm"], secondary["reference"])) == [("sigmoid", "dense"), ("norm", "dense d56")]
    assert secondary["p_adj"].tolist() == pytest.approx(holm(secondary["p"].tolist()))
    assert found[0].primary and found[0].statement.startswith("norm (the best of its family on val)")


def test_a_margin_turns_a_tie_into_equivalent_and_summary_carries_the_fields():
    df = frame([("dense", "dense", "", 1.0, 2.5, 2.5), ("sigmoid", "sigmoid", "", 1.0, 2.45, 2.5)], seeds=range(8))
    tie, _ = claims.mod_vs_best_dense(df, ClaimSettings(margin=0.05))
    assert tie[0].verdict_class == "equivalent" and tie[0].verdict.startswith("equivalent within ±0.05 bpb")
    assert tie[0].tost_p < 0.05 and tie[0].margin == 0.05
    plain, _ = claims.mod_vs_best_dense(df)  # no margin: a tie stays inconclusive
    assert plain[0].verdict_class == "inconclusive" and plain[0].tost_p is None
    assert set(tie[0].to_dict()) >= {"margin", "verdict_class", "primary", "tost_p"}
    better = frame([("dense", "dense", "", 1.0, 2.5, 2.5), ("sigmoid", "sigmoid", "", 1.0, 2.45, 2.48)], seeds=range(8))
    small, _ = claims.mod_vs_best_dense(better, ClaimSettings(margin=0.05))
    assert small[0].verdict_class == "better" and "within the ±0.05 margin" in small[0].verdict


def test_degenerate_arms_flags_the_collapsed_threshold_router_and_nothing_else():
    study = load_study(FIXTURES / "methods_shootout.toml")
    done = pd.read_csv(FIXTURES / "methods_shootout_trials.csv")
    done = done[done["state"] == "COMPLETE"]
    flagged = claims.degenerate_arms(done, study)
    assert list(flagged) == ["threshold C=0.125 alternate"] and "collapsed" in flagged["threshold C=0.125 alternate"]
    found, effects, _ = claims.test_claims(done, study)
    assert not effects["arm"].str.startswith("threshold").any()
    c4 = {c.statement.split(" has ")[0]: c for c in found if c.id.startswith("C4")}
    assert c4["threshold C=0.125 alternate"].verdict_class == "flagged"
    assert [c.verdict_class for c in c4.values()].count("flagged") == 1
    saturated = done.copy()  # a router that processes nearly everything is degenerate too
    saturated.loc[saturated["variant"] == "amod", "test/causal_fraction"] = 0.9
    assert set(claims.degenerate_arms(saturated, study)) == {"threshold C=0.125 alternate", "amod C=0.125 alternate"}


def test_a_claim_whose_primary_arm_is_degenerate_is_flagged_not_dropped():
    df = frame([("dense", "dense", "", 1.0, 2.5, 2.5), ("sigmoid", "sigmoid", "", 1.0, 2.4, 2.4),
                ("random_gated", "random_gated", "", 1.0, 2.6, 2.6), ("norm", "norm", "", 1.0, 2.45, 2.45)])
    flagged = {"sigmoid": "realised share 0 vs C = 0.25 (collapsed)"}
    c1, eff1 = claims.mod_vs_best_dense(df, ClaimSettings(), flagged)
    assert c1[0].verdict_class == "flagged" and "sigmoid" in c1[0].verdict and c1[0].estimate is None
    assert "sigmoid" not in set(eff1["arm"])  # norm − dense is still computed, as a secondary row
    c2, _ = claims.learned_vs_random(df, ClaimSettings(), flagged)
    assert c2[0].verdict_class == "flagged"
    c1_norm, _ = claims.mod_vs_best_dense(df, ClaimSettings(primary="norm"), flagged)
    assert c1_norm[0].verdict_class == "better" and c1_norm[0].statement.startswith("norm (the best of its family on val)")


# --- end to end: a tiny study, its report and summary.json ----------------------------------------
E2E_STUDY = STUDY.replace('variant = ["dense", "sigmoid", "random_gated"]', 'variant = ["dense", "sigmoid", "random_gated", "norm"]') \
    + '\n[claims.mod_vs_best_dense]\nprimary = "norm"\nmargin = 0.05\n'


def test_claims_report_end_to_end(tmp_cwd):
    """At 2e9 FLOPs sigmoid's causal rule (r > 0, trained by an aux BCE whose optimum at 25 %
    capacity starts at r < 0 everywhere) processes no token: both sigmoid arms are degenerate,
    excluded and named; norm (a calibrated threshold) is C1's declared primary contrast."""
    path = write(tmp_cwd, text=E2E_STUDY)
    assert main(["study", "run", str(path), "--quiet"]) == 0
    assert main(["report", str(path)]) == 0
    out = tmp_cwd / "reports" / "claims"
    text = (out / "report.md").read_text()
    body = text.split("\n", 6)[-1]
    assert body.lstrip("\n> *").startswith(("Under-trained", "Every arm beats"))  # the regime comes first
    # No [tune] table: the opening says the arms are not compared best against best.
    assert "Not tuned: the arms are not compared best against best" in text.split("## Claims")[0]
    for heading in ("## Claims", "## Arms (deployable metric first)", "## Sanity baselines", "## Effects",
                    "## The causal rule against top-k", "## isoFLOP profiles", "## Learning curves"):
        assert heading in text, heading
    assert text.index("## Claims") < text.index("# Details")
    for fig in ("effects", "curves_flops", "curves_tokens", "isoflop"):
        assert (out / f"{fig}.png").is_file() and (out / f"{fig}.pdf").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert [c["id"] for c in summary["claims"]] == ["C1", "C2", "C3a", "C3b"]
    for c in summary["claims"]:
        assert set(c) >= {"id", "statement", "verdict", "estimate", "ci_low", "ci_high", "n_seeds", "margin",
                          "verdict_class", "primary", "tost_p"}
    c1, c2 = summary["claims"][:2]
    assert c1["statement"].startswith("norm C=0.25 alternate (the best of its family on val)") and c1["margin"] == 0.05 and c1["primary"]
    assert c1["verdict_class"] in ("better", "worse", "equivalent", "inconclusive", "regime not reached")
    if c1["verdict_class"] == "regime not reached":  # at 2e9 FLOPs: the gate names who does not beat the 4-gram
        assert "do" in c1["verdict"] and "not beat the count 4-gram" in c1["verdict"]
    # Pre-registered when the study was created (no [tune]: every trial confirms), with the commit.
    registration = summary["preregistration"]
    assert registration["claims"]["mod_vs_best_dense"]["margin"] == 0.05 and registration["amendments"] == []
    assert all(c["fixed_at_commit"] == registration["commit"] for c in summary["claims"])
    assert "pre-registered at commit" in text.split("## Claims")[0]
    flagged = summary["degenerate_arms"]
    assert set(flagged) == {"sigmoid C=0.25 alternate", "sigmoid C=0.25 alternate lr×2"}
    assert all("collapsed" in why for why in flagged.values()) and all(arm in text for arm in flagged)
    assert c2["verdict_class"] == "flagged" and summary["claims"][2]["verdict_class"] == "flagged"
    assert set(summary["baselines"]) >= {"unigram", "bigram", "trigram", "zstd"}
    # every arm's number is recomputed from the trials
    trials = pd.read_csv(out / "trials.csv")
    trials = trials[trials.state == "COMPLETE"]
    arms = {a["arm"]: a for a in summary["arms"]}
    assert any("FLOP-matched" in a for a in arms) and any("iso-tokens" in a for a in arms)
    assert len(arms) == 9 and all(a["n_seeds"] == 2 for a in arms.values())
    by_label = pd.read_csv(out / "arms_causal.csv").set_index("arm")
    for arm, a in arms.items():
        assert a["causal_bpb"] == pytest.approx(by_label.loc[arm, "causal_bpb"])
    # C1's estimate is the paired mean difference of the arms it names, on test
    eff = pd.read_csv(out / "effects.csv")
    primary = eff[(eff.claim == "C1") & (eff.family == "primary")].iloc[0]
    assert summary["claims"][0]["estimate"] == pytest.approx(primary["estimate"])
    assert not (set(eff["arm"]) | set(eff["reference"])) & set(flagged)  # excluded from every family
    assert not re.search(r"\bnan\b", text.lower())  # a word, not "nanochat"


def test_the_regime_line_names_every_arm_below_the_trigram_and_says_whose_conclusions_fail():
    from modbench.report.baselines import Baselines
    from modbench.report.render import regime_lines

    base = {"test": Baselines("test", 1000, 4.0, 3.0, 2.7, 2.0, 1.8, 1.9)}
    arms = pd.DataFrame({"arm": ["sigmoid", "dense", "dense L6"], "variant": ["sigmoid", "dense", "dense"],
                         "causal_bpb": [2.2, 2.4, 3.4]})
    line = regime_lines(arms, base)[0]
    assert "1 of 3 arms do not beat" in line and "dense L6 (3.4)" in line and "Every routed arm beats" in line
    arms.loc[0, "causal_bpb"] = 2.9  # now a routed arm is below the trigram too
    assert "routing conclusions are unreliable" in regime_lines(arms, base)[0]
    assert regime_lines(arms.iloc[[1]], base)[0].startswith("Every arm beats")


def test_a_claim_whose_compared_arms_do_not_beat_the_4gram_gets_no_verdict():
    """The regime gate (issue "Best against best", item 4): where a claim's compared arms do not beat
    the count 4-gram on the arms' own test windows, the claim says "regime not reached" and names them
    instead of a verdict; its numbers stay; a claim whose arms beat it keeps its verdict."""
    from modbench.report.baselines import Baselines
    from modbench.report.claims import Claim, positive_control_line
    from modbench.report.render import claim_sentence
    from modbench.report.sections import REGIME_NOT_REACHED, regime_gate

    base = {"test": Baselines("test", 1000, 5.0, 3.5, 2.8, 2.5, 2.4, 2.3, 2.3, 2.5, 2.2, 990)}  # bar: 2.2
    arms = pd.DataFrame({"arm": ["sigmoid", "dense", "random_gated", "dense small"], "causal_bpb": [1.9, 2.1, 2.4, 2.0]})
    effects = pd.DataFrame([
        {"claim": "C1", "claim_id": "C1", "arm": "sigmoid", "reference": "dense"},
        {"claim": "C2", "claim_id": "C2", "arm": "sigmoid", "reference": "random_gated"},
        {"claim": "C1+", "claim_id": "C1+", "arm": "dense small", "reference": "dense"},
    ])
    claims = [Claim("C1", "MoD vs dense", "MoD is better", -0.2, -0.3, -0.1, 3, verdict_class="better"),
              Claim("C2", "learned vs random", "learned is better", -0.5, -0.6, -0.4, 3, verdict_class="better"),
              Claim("C3a", "causal rule vs chance", "above chance", 0.1, 0.05, 0.15, 3, verdict_class="better"),
              Claim("C1+", "positive control", "passed", 0.1, 0.05, 0.15, 3, verdict_class="worse")]
    gated = {c.id: c for c in regime_gate(claims, effects, arms, base)}
    assert gated["C1"] == claims[0] and gated["C1+"] == claims[3]  # both sides beat 2.2: verdicts stand
    assert gated["C3a"] == claims[2]  # no arms of its own: gated only when no arm beats the bar
    c2 = gated["C2"]
    assert c2.verdict_class == REGIME_NOT_REACHED and "random_gated (2.400)" in c2.verdict and "sigmoid" not in c2.verdict
    assert (c2.estimate, c2.ci_low, c2.ci_high, c2.n_seeds) == (-0.5, -0.6, -0.4, 3)  # the numbers stay
    sentence = claim_sentence(c2, effects)
    assert "regime not reached" in sentence and "better" not in sentence and "-0.500" in sentence.replace("−", "-")
    # Nothing beats the bar: every claim is gated, the within-run one too, and the positive control decides nothing.
    worse = arms.assign(causal_bpb=[2.3, 2.4, 2.5, 2.6])
    everything = regime_gate(claims, effects, worse, base)
    assert {c.verdict_class for c in everything} == {REGIME_NOT_REACHED}
    assert positive_control_line(everything).startswith("**The positive control decides nothing here:**")


def test_primary_claims_are_holm_corrected_across_the_study():
    """Each claim's primary contrast is its own family, but a study tests several (issue "Best against
    best", item 5): Holm across them, the positive control left out; a claim significant on its own
    but not after the correction is reclassed and says why."""
    from modbench.report.claims import Claim, holm_across_primaries

    effects = pd.DataFrame([
        {"claim": "C1", "claim_id": "C1", "family": "primary", "arm": "a", "reference": "d", "estimate": -0.1,
         "p": 0.03, "tost_p": None},
        {"claim": "C2", "claim_id": "C2", "family": "primary", "arm": "a", "reference": "r", "estimate": -0.2,
         "p": 0.04, "tost_p": 0.5},
        {"claim": "C2", "claim_id": "", "family": "secondary", "arm": "b", "reference": "r2", "estimate": -0.2,
         "p": 0.001, "tost_p": None},
        {"claim": "C1+", "claim_id": "C1+", "family": "primary", "arm": "s", "reference": "d", "estimate": 0.3,
         "p": 0.001, "tost_p": None},
    ])
    claims = [Claim("C1", "s1", "better", -0.1, -0.2, -0.01, 4, verdict_class="better"),
              Claim("C2", "s2", "better", -0.2, -0.3, -0.05, 4, verdict_class="better"),
              Claim("C1+", "pc", "passed", 0.3, 0.2, 0.4, 4, verdict_class="worse")]
    out, eff = holm_across_primaries(claims, effects)
    by = {c.id: c for c in out}
    assert eff.loc[0, "p_primaries"] == pytest.approx(0.06) and eff.loc[1, "p_primaries"] == pytest.approx(0.06)
    assert pd.isna(eff.loc[2, "p_primaries"]) and pd.isna(eff.loc[3, "p_primaries"])  # secondary, positive control
    assert by["C1"].verdict_class == "inconclusive" and "after Holm across the study's 2 primary claims" in by["C1"].verdict
    assert by["C2"].verdict_class == "inconclusive" and by["C1+"] == claims[2]
    # A single primary: the study's correction is its own, and nothing changes.
    single, eff1 = holm_across_primaries(claims[:1] + claims[2:], effects.iloc[[0, 3]])
    assert single == claims[:1] + claims[2:] and eff1["p_primaries"].isna().all()


def test_a_tie_at_different_cost_names_the_costs_and_the_declared_winner():
    """paper_claims' C1 tied MoD with a dense model that was cheaper to decode and to train, and the
    report never said that a tie goes to the cheaper arm (issue "Best against best"): a tie now states
    both costs, and the claim's declared tie_break names the winner, or says none was declared."""
    from types import SimpleNamespace

    from modbench.design.study_file import ClaimSettings
    from modbench.report.claims import Claim
    from modbench.report.render import tie_lines
    from modbench.report.sections import tie_records

    arms = pd.DataFrame({"arm": ["mod", "dense"], "decode_flops_per_token": [1.25e6, 1.0e6],
                         "flops_per_token": [3.87e6, 3.0e6]})
    effects = pd.DataFrame([{"claim": "C1", "claim_id": "C1", "family": "primary", "arm": "mod", "reference": "dense"}])
    tie = [Claim("C1", "MoD vs dense", "equivalent", 0.003, -0.02, 0.03, 8, margin=0.025, verdict_class="equivalent")]
    ruled = SimpleNamespace(claim_settings={"mod_vs_best_dense": ClaimSettings(margin=0.025, tie_break="decode_flops")})
    records = tie_records(tie, effects, arms, ruled)
    lines = tie_lines(records)
    assert "mod costs +25% decode FLOPs/token and +29% training FLOPs/token against dense" in lines[0]
    assert "**dense wins**" in lines[0] and records[0]["winner"] == "dense"
    unruled = SimpleNamespace(claim_settings={"mod_vs_best_dense": ClaimSettings(margin=0.025)})
    records = tie_records(tie, effects, arms, unruled)
    assert "declares no rule" in tie_lines(records)[0] and records[0]["winner"] is None
    better = [Claim("C1", "MoD vs dense", "better", -0.1, -0.2, -0.05, 8, verdict_class="better")]
    assert tie_records(better, effects, arms, ruled) == [] and tie_lines([]) == []  # only a tie needs the rule


def test_a_tie_rule_needs_a_margin_and_a_known_cost(tmp_path):
    from modbench.design.study_file import load_study
    from modbench.errors import ModbenchError

    base = STUDY.replace("{name}", "tie") + '\n[claims.mod_vs_best_dense]\n'
    for extra, message in (('tie_break = "decode_flops"\n', "needs a margin"),
                           ('margin = 0.05\ntie_break = "wall_clock"\n', "expected 'decode_flops' or 'train_flops'")):
        path = tmp_path / "tie.toml"
        path.write_text(base + extra)
        with pytest.raises(ModbenchError, match=message):
            load_study(path)
    path.write_text(base + 'margin = 0.05\ntie_break = "train_flops"\n')
    assert load_study(path).claim_settings["mod_vs_best_dense"].tie_break == "train_flops"
