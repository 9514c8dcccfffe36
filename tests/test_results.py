"""The results record: declared names, aliases, round trip."""

import pytest

from modbench.errors import ModbenchError
from modbench.results import ALIASES, METRICS, RunRecord, declared, metric


def test_every_declared_metric_has_a_unit_and_a_direction():
    for name, m in METRICS.items():
        assert m.name == name and m.unit and m.direction in ("minimize", "maximize") and m.description
    assert metric("val/bpb").direction == "minimize" and metric("perf/train_tokens_per_s").direction == "maximize"


def test_old_spellings_are_aliases_of_declared_names():
    for old, new in ALIASES.items():
        assert new in METRICS and metric(old) is METRICS[new]
    with pytest.raises(ModbenchError, match="unknown metric 'val_bbp'"):
        metric("val_bbp")


def test_record_round_trip_and_only_declared_metrics():
    rec = RunRecord("a" * 32, "FINISHED", {"routing.variant": "sigmoid"},
                    declared({"val/bpb": 2.5, "val/causal_bpb": 2.6, "train/loss": 1.0}), 10, 1280, "checkpoint/checkpoint.pt")
    assert set(rec.metrics) == {"val/bpb", "val/causal_bpb"}  # train/loss is logged, not part of the record
    again = RunRecord.from_dict(rec.to_dict())
    assert again == rec and again.value("val_bpb") == 2.5  # an alias reads the declared value
    with pytest.raises(ModbenchError, match="'bpb' is not declared"):
        RunRecord(None, "FINISHED", {}, {"bpb": 1.0})
