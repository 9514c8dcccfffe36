"""The training harness: learning, budgets, determinism, resume, MLflow, bad input."""

import math
from dataclasses import replace

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from modbench import variants
from modbench.config.budget import Budget
from modbench.cli.main import main
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.data import load_corpus
from modbench.errors import ModbenchError
from modbench.model.gpt import GPT
from modbench.config.run import RunConfig, TrainConfig
from modbench.run.train import TrainingDiverged, train

TINY = ModelConfig(depth=2, n_embd=64, head_dim=16, max_seq_len=64)


def tiny(variant="sigmoid", capacity=0.25, **train_kw) -> RunConfig:
    t = dict(dataset="arithmetic", seq_len=64, batch_size=8, budget="steps=20", eval_every=10,
             log_every=5, eval_windows=8, track=False, out_dir="runs", lr=3e-3)
    t.update(train_kw)
    return RunConfig(TINY, RoutingConfig(variant, capacity), TrainConfig(**t))


def train_losses(result):
    return [h["train/loss"] for h in result.history if "train/loss" in h]


@pytest.mark.slow
def test_tiny_model_learns_arithmetic_well_below_unigram_entropy(tmp_cwd):
    cfg = tiny("sigmoid", 0.5, budget="steps=150", eval_every=150, batch_size=16)
    result = train(cfg, progress=False)
    unigram = load_corpus("arithmetic").unigram_entropy_bits("val")
    assert unigram > 3.5
    assert result.val["bpb"] < 0.75 * unigram
    assert result.test["bpb"] < 0.75 * unigram
    # routing is scored against the hard-byte labels
    assert 0.0 <= result.val["hard_precision"] <= 1.0 and 0 < result.val["hard_base_rate"] < 0.5


@pytest.mark.parametrize("name", variants.list_variants())
def test_every_variant_trains_a_few_steps(tmp_cwd, name):
    result = train(tiny(name, budget="steps=4", eval_every=100, log_every=2), progress=False)
    assert result.steps == 4
    assert all(math.isfinite(x) for x in train_losses(result))
    assert math.isfinite(result.val["bpb"])
    if name != "dense":
        assert any(k.startswith("route/L1/fraction") for h in result.history for k in h)


def test_flop_budget_gives_mod_proportionally_more_steps():
    base = tiny("dense", budget="flops=5e11")
    mod = replace(base, routing=RoutingConfig("sigmoid", 0.125, pattern="alternate"))
    tokens = 8 * 64
    steps = {}
    for cfg in (base, mod):
        m = GPT(cfg.model, cfg.routing)
        steps[cfg.routing.variant] = (Budget.parse(cfg.train.budget).steps(tokens, m.flops_per_token(64) * tokens),
                                      m.flops_per_token(64))
    (s_dense, f_dense), (s_mod, f_mod) = steps["dense"], steps["sigmoid"]
    assert s_mod > s_dense
    assert s_mod / s_dense == pytest.approx(f_dense / f_mod, rel=0.02)
    assert s_dense * f_dense * tokens <= 5e11 and (s_dense + 1) * f_dense * tokens > 5e11


def test_budget_kinds_and_errors():
    assert Budget.parse("steps=10").steps(100, 1e9) == 10
    assert Budget.parse("tokens=1000").steps(100, 1e9) == 10
    assert Budget.parse("flops=1e10").steps(100, 1e9) == 10
    assert Budget.parse("seconds=5").steps(100, 1e9) is None
    for bad in ("flops=0", "steps=-3", "flops=inf", "minutes=3", "flops", "flops=abc"):
        with pytest.raises(ModbenchError, match="expected 'steps=N'"):
            Budget.parse(bad)
    with pytest.raises(ModbenchError, match="smaller than one training step"):
        Budget.parse("flops=10").steps(100, 1e9)


@pytest.mark.parametrize("name", ["sigmoid", "random"])
def test_same_seed_same_losses_bit_for_bit(tmp_cwd, name):
    a = train(tiny(name), progress=False)
    b = train(tiny(name), progress=False)
    assert train_losses(a) == train_losses(b) and len(train_losses(a)) == 4
    assert a.val == b.val
    c = train(tiny(name, seed=1), progress=False)
    assert train_losses(c) != train_losses(a)


class Stop(Exception):
    pass


@pytest.mark.parametrize("name", ["learned_temperature", "random"])
def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_cwd, name):
    full = train(tiny(name, checkpoint_every=10, out_dir="full"), progress=False)

    def interrupt(step, val):
        if step == 10:
            raise Stop

    cfg = tiny(name, checkpoint_every=10, out_dir="parts")
    with pytest.raises(Stop):
        train(cfg, progress=False, on_eval=interrupt)
    resumed = train(cfg, progress=False, resume=True)
    assert resumed.steps == 20
    assert train_losses(resumed) == train_losses(full)
    assert resumed.val == full.val and resumed.test == full.test


def test_resume_without_checkpoint_is_a_clear_error(tmp_cwd):
    with pytest.raises(ModbenchError, match="no checkpoint"):
        train(tiny(), progress=False, resume=True)


def test_nan_loss_stops_the_run_and_marks_it_failed(tmp_cwd, monkeypatch):
    uri = f"sqlite:///{tmp_cwd}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    real_forward = GPT.forward

    def poisoned(self, idx, targets=None):
        out = real_forward(self, idx, targets)
        if targets is not None and self.training:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(TrainingDiverged, match="training loss became nan at step 5"):
        train(tiny(track=True, experiment="nan-test"), progress=False)
    runs = mlflow.search_runs(experiment_names=["nan-test"], output_format="list")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_mlflow_run_has_params_step_metrics_and_artifacts(tmp_cwd, monkeypatch):
    uri = f"sqlite:///{tmp_cwd}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    result = train(tiny("sigmoid", track=True, experiment="harness-test", system_metrics_s=0.2), progress=False)
    mlflow.set_tracking_uri(uri)
    df = mlflow.search_runs(experiment_names=["harness-test"])
    assert len(df) == 1
    row = df.iloc[0]
    assert row["run_id"] == result.run_id and row["status"] == "FINISHED"
    assert row["params.routing.variant"] == "sigmoid" and row["params.routing.capacity"] == "0.25"
    assert row["params.model.depth"] == "2" and int(row["params.budget.resolved_steps"]) == 20
    assert len(row["tags.dataset_sha256"]) == 64 and row["tags.device"] == "cpu"
    assert "tags.git_sha" in df.columns or any("git" in c for c in df.columns)
    client = MlflowClient(uri)
    history = client.get_metric_history(result.run_id, "train/loss")
    assert [m.step for m in history] == [5, 10, 15, 20]
    assert len(client.get_metric_history(result.run_id, "route/L1/fraction")) == 4
    assert client.get_metric_history(result.run_id, "val/bpb")[-1].step == 20
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"config.json", "routing_heatmap.png"} <= artifacts
    assert not (tmp_cwd / "mlruns").exists()
    # the dataset is a run input (MLflow's dataset tracking), named, fingerprinted, with its context
    (logged,) = client.get_run(result.run_id).inputs.dataset_inputs
    assert logged.dataset.digest == row["tags.dataset_sha256"][:36] and logged.dataset.name.startswith("arithmetic")
    assert [(t.key, t.value) for t in logged.tags] == [("mlflow.data.context", "training")]
    # MLflow's own system-metrics monitor sampled the run (CPU and memory)
    system = set(client.get_run(result.run_id).data.metrics)
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system
    # the overhead is measured after the artifacts are written (their waits count) and is the one logged
    (overhead,) = client.get_metric_history(result.run_id, "perf/logging_overhead")
    assert overhead.value == result.logging_overhead and 0 < overhead.value < 1


def test_cli_config_file_and_flags(tmp_cwd, capsys):
    (tmp_cwd / "run.toml").write_text(
        '[model]\ndepth = 2\nn_embd = 64\nhead_dim = 16\nmax_seq_len = 64\n'
        '[routing]\nvariant = "sigmoid"\ncapacity = 0.5\n[routing.options]\naux_weight = 0.05\n'
        '[train]\ndataset = "arithmetic"\nseq_len = 32\nbatch_size = 4\nbudget = "steps=3"\neval_windows = 4\n'
    )
    rc = main(["train", "--config", "run.toml", "--capacity", "0.25", "--no-track", "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert '"steps": 3' in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dataset", "wikitext"], "unknown dataset 'wikitext'"),
        (["--dataset", "no/such/file.txt"], "dataset file 'no/such/file.txt' does not exist"),
        (["--budget", "flops=0"], "must be positive"),
        (["--budget", "flops=-1e12"], "budget"),
        (["--capacity", "1.5"], "expected a fraction in (0, 1]"),
        (["--variant", "sigmod"], "did you mean 'sigmoid'"),
        (["--pattern", "zigzag"], "layer pattern 'zigzag'"),
        (["--option", "bogus=1"], "has no option 'bogus'"),
        (["--depth", "two"], "wrong type"),
        (["--seq-len", "4096"], "exceeds model.max_seq_len"),
        (["--config", "missing.toml"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_cwd, capsys, argv, message):
    rc = main(["train", "--quiet", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_cwd / "mlflow.db").exists() and not (tmp_cwd / "runs").exists()


def test_checksum_mismatch_is_refused_before_anything_is_written(tmp_cwd, monkeypatch, capsys):
    data = tmp_cwd / "data"
    data.mkdir()
    (data / "tinyshakespeare.txt").write_bytes(b"x" * 1_115_394)
    monkeypatch.setenv("MODBENCH_DATA_DIR", str(data))
    rc = main(["train", "--dataset", "tinyshakespeare", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "corrupt" in err
    assert not (tmp_cwd / "mlflow.db").exists() and not (tmp_cwd / "runs").exists()


def test_a_per_step_metric_is_one_registered_function(tmp_cwd, monkeypatch):
    """Adding a per-step metric: one function decorated with ``step_metric``; it is logged
    every log_every steps beside the built-in ones, with the logging window it is given."""
    from modbench.run import step_metrics

    monkeypatch.setattr(step_metrics, "STEP_METRICS", list(step_metrics.STEP_METRICS))

    @step_metrics.step_metric
    def steps_in_window(run, window):
        return {"test/window_steps": float(window.steps), "test/step": float(run.step)}

    result = train(tiny("sigmoid", budget="steps=6", eval_every=100, log_every=3), progress=False)
    logged = [h for h in result.history if "test/window_steps" in h]
    assert [(h["step"], h["test/window_steps"], h["test/step"]) for h in logged] == [(3, 3.0, 3.0), (6, 3.0, 6.0)]
    assert all("train/loss" in h and "train/bpb" in h for h in logged)
    assert all(h["train/bpb"] == pytest.approx(h["train/loss"] / math.log(2)) for h in logged)


def test_tracking_uri_flag_is_where_the_run_goes(tmp_cwd, monkeypatch):
    """`--tracking-uri` beats the environment and the ./mlflow.db default, for train and generate."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_cwd}/from-env.db")
    store = tmp_cwd / "elsewhere" / "store.db"
    store.parent.mkdir()
    argv = ["train", "--variant", "sigmoid", "--capacity", "0.25", "--depth", "2", "--n-embd", "64", "--head-dim", "16",
            "--max-seq-len", "64", "--seq-len", "64", "--batch-size", "8", "--dataset", "arithmetic",
            "--budget", "steps=2", "--eval-every", "100", "--eval-windows", "4", "--experiment", "flag-test",
            "--tracking-uri", f"sqlite:///{store}", "--quiet"]
    assert main(argv) == 0
    assert store.is_file() and not (tmp_cwd / "from-env.db").exists() and not (tmp_cwd / "mlflow.db").exists()
    runs = MlflowClient(f"sqlite:///{store}").search_runs(
        [MlflowClient(f"sqlite:///{store}").get_experiment_by_name("flag-test").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    # generate finds the run by id through the same flag (and not through the environment).
    assert main(["generate", "--run", runs[0].info.run_id, "--prompt", "1+1=", "--max-new-tokens", "2",
                 "--no-dense", "--json", "--tracking-uri", f"sqlite:///{store}"]) == 0


@pytest.mark.parametrize("variant,warmup", [("sigmoid", 0), ("sigmoid", 8), ("token_choice", 0), ("random", 0),
                                            ("mode_staged", 0)])
def test_a_compiled_run_compiles_two_graphs_even_through_a_capacity_warmup(tmp_cwd, monkeypatch, variant, warmup):
    """`--compile`: the forward compiles to one graph for the logging steps and one for the others. A capacity
    warm-up changes k nearly every step, and a compiled forward specialised on each k recompiled until Dynamo's
    limit, then ran the rest of training eagerly; the warm-up now runs eagerly and the compiled forward after it.
    The evaluation at step 10 (its causal agreement, a calibration) recompiles nothing either: the router
    flags it sets were first created on the instance there. A mixture of experts (``mode_staged``) reads its
    slice sizes on the host: the run compiles under the model's ``compile_settings``, which keep that read
    inside the graph (without them: a break and a recompile for each new split). (Dynamo's "eager" backend:
    its tracing and guards, without Inductor's code generation.)"""
    import torch

    graphs, first_compiled_step = [], []
    real_compile = torch.compile

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def compile_recording(model, **kw):
        compiled = real_compile(model, backend=record)

        def forward(*a, **k):  # (the step the compiled forward first ran at)
            first_compiled_step.append(run_step[0])
            return compiled(*a, **k)
        return forward

    run_step = [0]
    monkeypatch.setattr(torch, "compile", compile_recording)
    torch._dynamo.reset()
    cfg = tiny(variant, 0.125, budget="steps=16", compile=True)
    cfg = replace(cfg, routing=replace(cfg.routing, capacity_warmup_steps=warmup))
    from modbench.model import gpt

    real_set_step = gpt.GPT.set_step
    monkeypatch.setattr(gpt.GPT, "set_step", lambda self, step: (run_step.__setitem__(0, step), real_set_step(self, step)))
    result = train(cfg, progress=False)
    assert result.steps == 16
    assert min(first_compiled_step) == warmup  # the warm-up eager, every step after it compiled
    assert len(first_compiled_step) == 16 - warmup
    assert len(graphs) == 2  # logging steps and the others, whatever the warm-up did


def test_a_compiled_cpu_run_trains_under_deterministic_algorithms_and_restores_the_flag(tmp_cwd, monkeypatch):
    """Inductor's CPU kernels accumulate in a varying order unless deterministic algorithms are on: two
    compiled runs of one seed differed (val bpb 3.70958 against 3.70973 after 80 steps, L2 d64) where eager
    reruns match bit for bit; with the flag they match again. A compiled CPU run sets it for its steps, and
    leaves it as it found it; an eager run leaves it alone. (Dynamo's "eager" backend: no code generation.)"""
    import torch

    seen = []
    real_compile = torch.compile

    def compile_eager(model, **kw):
        compiled = real_compile(model, backend="eager")

        def forward(*a, **k):
            seen.append(torch.are_deterministic_algorithms_enabled())
            return compiled(*a, **k)
        return forward

    monkeypatch.setattr(torch, "compile", compile_eager)
    torch._dynamo.reset()
    assert not torch.are_deterministic_algorithms_enabled()
    train(tiny("sigmoid", 0.125, budget="steps=4", compile=True), progress=False)
    assert seen == [True] * 4 and not torch.are_deterministic_algorithms_enabled()
    seen.clear()
    train(tiny("sigmoid", 0.125, budget="steps=2"), progress=False)  # eager: the compiled forward never runs
    assert seen == [] and not torch.are_deterministic_algorithms_enabled()
