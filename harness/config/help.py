"""What each config field means, for ``--help`` (one entry per field of every section).

The grammars come from the modules that parse them (budgets, layer patterns, capacity
schedules, datasets, devices), so the help and the parser cannot disagree.
"""

from __future__ import annotations

from modbench.config.budget import FORM as BUDGET_FORMS
from modbench.config.capacity import SCHEDULES
from modbench.config.patterns import FORMS as PATTERN_FORMS
from modbench.data import KNOWN_DATASETS

DEVICES = ("auto", "cpu", "cuda")

MODEL = {
    "depth": "layers; also sets the width (n_embd = depth × aspect_ratio, nanochat's depth parameterisation)",
    "aspect_ratio": "width per layer of depth: n_embd = depth × aspect_ratio, rounded up to a multiple of head_dim",
    "head_dim": "width of one attention head: n_head = n_embd / head_dim",
    "n_layer": "layers, overriding --depth",
    "n_embd": "model width, overriding depth × aspect_ratio",
    "n_head": "attention heads, overriding n_embd / head_dim",
    "vocab_size": "vocabulary size; the data are bytes, so at least 256",
    "max_seq_len": "longest sequence the model is built for (RoPE tables, the causal mask)",
    "mlp_ratio": "MLP hidden width ÷ model width",
    "rope_base": "RoPE frequency base",
    "recursion": "weight sharing across depth: 'none', 'cycle' (the whole stack is one block, cycled) or "
                 "'middle_cycle' (first and last layers unshared; Mixture-of-Recursions' default); --depth stays "
                 "the effective depth",
    "recursions": "N_R, applications of the shared block: 2, 3 or 4 with --recursion (1 without)",
    "kv_sharing": "recursive KV sharing (Mixture-of-Recursions §2.3): every later application of the shared block "
                  "attends to the keys and values of its first application and caches none of its own; needs --recursion",
}

ROUTING = {
    "variant": "routing variant: a name that 'modbench variants' lists (dense, norm, sigmoid, ...)",
    "capacity": "share of tokens a routed layer processes, in (0, 1]: k = capacity × T (Raposo et al. 2024 §3.1)",
    "schedule": f"capacity over sequence length: {' or '.join(map(repr, SCHEDULES))} "
                "('log': the log-scaled capacity of the nanochat fork's MoD documentation)",
    "pattern": f"which layers are routed: {PATTERN_FORMS}",
    "capacities": "one capacity per routed layer, comma-separated, fractions allowed (e.g. '1,2/3,1/3': "
                  "Mixture-of-Recursions' per-step capacities); the last must equal --capacity; excludes --capacity-first",
    "capacity_first": "capacity of the first routed layer, decaying along a cosine to --capacity at the last "
                      "(p-MoD's progressive ratio decay); default: every routed layer at --capacity",
    "capacity_warmup_steps": "steps over which every routed layer's capacity falls from 1.0 to its own (0: none)",
}

TRAIN = {
    "dataset": f"{', '.join(KNOWN_DATASETS)}, or the path of a file (bytes)",
    "seq_len": "training sequence length in bytes (at most --max-seq-len)",
    "batch_size": "sequences per micro-batch",
    "grad_accum": "micro-batches per optimizer step",
    "budget": f"training budget: {BUDGET_FORMS}; a FLOP budget is converted to steps with the model's own FLOPs",
    "lr": "peak AdamW learning rate at n_embd = 768 (scaled by (n_embd/768)^-0.5 with --scale-hparams)",
    "weight_decay": "AdamW weight decay at depth 12 (scaled by (12/depth)^2 with --scale-hparams)",
    "scale_hparams": "scale lr and weight decay with the model's size (nanochat's rules)",
    "min_lr_ratio": "final learning rate ÷ peak (cosine decay)",
    "warmup_frac": "share of the budget spent in linear learning-rate warm-up",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "grad_clip": "gradient-norm clipping threshold",
    "eval_every": "steps between validation evaluations",
    "eval_windows": "fixed validation/test windows per evaluation (the same bytes for every run)",
    "system_metrics_s": "seconds between MLflow system-metrics samples (CPU, memory, GPU); 0: off",
    "log_every": "steps between logged training metrics",
    "checkpoint_every": "steps between checkpoints (0: only at the end)",
    "seed": "fixes data order, initialisation and routing (CPU reruns match bit for bit)",
    "device": f"{', '.join(DEVICES)} (auto: cuda when available); precision follows the device: "
              "bf16 autocast on cuda, float32 on cpu",
    "compile": "torch.compile the model",
    "out_dir": "folder for run folders (checkpoints)",
    "experiment": "MLflow experiment name",
    "run_name": "MLflow run name and run folder (default: the arm and seed plus a hash of the whole config)",
    "track": "log the run to MLflow (--no-track: log nothing)",
}

SECTIONS = {"model": MODEL, "routing": ROUTING, "train": TRAIN}
