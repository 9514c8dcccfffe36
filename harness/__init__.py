"""modbench harness: model, FLOPs, data, training, tracking, studies, statistics, reports."""

__version__ = "0.1.0"
