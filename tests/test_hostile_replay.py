"""A replay corpus of over 200 hostile inputs to `modbench train`: each is refused before anything is
written, with exit 2 and one line that names the field (or flag) at fault.

The corpus is generated from the config's own fields (every bounded number gets the values that
break a number: negative, NaN, infinite, overflowing, not a number, empty, absurdly large) plus the
string-valued settings' classic mistakes, so a new field is covered the day it is added.
"""

import contextlib
import dataclasses
import io
import os

import pytest

from modbench.cli.main import main
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.run import TrainConfig

BAD_NUMBERS = ["-1", "nan", "inf", "1e400", "x", "", "99999999999999999999"]
# Fields where one of those values is legitimately accepted.
ALLOWED = {("rope_base", "99999999999999999999"), ("grad_clip", "99999999999999999999")}


def numeric_cases():
    for cls in (ModelConfig, RoutingConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            if f.type not in ("int", "float", "int | None", "float | None") or f.name in ("capacity",):
                continue
            for value in BAD_NUMBERS:
                if (f.name, value) not in ALLOWED:
                    yield [f"--{f.name.replace('_', '-')}", value], f.name


STRING_CASES = [
    (["--capacity", v], "capacity") for v in ("0", "-0.5", "1.5", "nan", "inf", "", "half")
] + [
    (["--variant", v], "variant") for v in ("nrom", "", "NORM", "../sigmoid", "sigmoid;rm", "d" * 300)
] + [
    (["--pattern", v], "pattern") for v in ("alternating", "", "fixed:9,9", "every:0", "DMX", "fixed:-1,0", "all,all")
] + [
    (["--schedule", v], "schedule") for v in ("lg", "", "LOG", "cosine")
] + [
    (["--budget", v], "budget") for v in ("steps=0.5", "tokens=1", "flops=1", "flops=-3", "steps=", "hours=2", "",
                                           "flops=nan", "flops=inf", "steps=1e400", "1e13")
] + [
    (["--dataset", v], "dataset") for v in ("no/such/file", "", "wikitext", "../../../etc/shadow-not-here")
] + [
    (["--device", v], "device") for v in ("tpu", "", "cuda:x", "mps2")
] + [
    (["--option", v], "option") for v in ("bogus=1", "=", "aux_weight", "aux_weight=-1", "aux_weight=x")
] + [
    (["--variant", "sigmoid", "--option", v], "option") for v in ("gate=maybe", "aux_weight=nan", "zz=1")
] + [
    (["--experiment", v], "experiment") for v in ("", "a/b", "../x", "x" * 300)
] + [
    (["--run-name", v], "run_name") for v in ("../../x", "a/b", "x" * 300)
] + [
    (["--config", v], "config") for v in ("no-such.toml", "", "/")
]
CASES = [*numeric_cases(), *STRING_CASES]


def test_the_corpus_has_over_200_inputs():
    assert len(CASES) >= 200


@pytest.mark.parametrize("argv, field", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_each_hostile_input_is_one_line_naming_the_field_and_writes_nothing(argv, field, tmp_cwd):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--dataset", "arithmetic", *argv])
    line = err.getvalue().strip()
    assert code == 2, (argv, line)
    assert len(line.splitlines()) == 1 and line.startswith("modbench: error: "), line
    flag = "--" + field.replace("_", "-")
    assert field in line or flag in line or field.replace("_", " ") in line, (argv, line)
    assert os.listdir(tmp_cwd) == [], "a refused input wrote files"
