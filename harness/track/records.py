"""Run records read back from MLflow: a run's declared metrics and its checkpoint artifact.

The trainer logs the checkpoint as the run's artifact ``checkpoint/checkpoint.pt`` and names
it in the tag ``modbench.checkpoint``; ``report`` and ``generate`` fetch it from the tracking
server or store (``mlflow.artifacts.download_artifacts``), so they work from any machine that
reaches the server, with no shared disk and no path conventions.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from modbench.errors import ModbenchError
from modbench.results import RunRecord, declared
from modbench.track.store import connect

CHECKPOINT_ARTIFACT_DIR = "checkpoint"  # the run's artifact folder that holds checkpoint.pt
CHECKPOINT_TAG = "modbench.checkpoint"  # on the run: the artifact path of its checkpoint


def read_record(uri: str, run_id: str) -> RunRecord:
    """The record of MLflow run ``run_id`` in ``uri`` (metrics by their declared names)."""
    try:
        run = connect(uri).get_run(run_id)
    except ModbenchError:
        raise
    except Exception:
        raise ModbenchError(f"no MLflow run {run_id} in {uri}: pass the --tracking-uri of the store that has it") from None
    params = run.data.params
    steps = params.get("budget.resolved_steps", "")
    tokens_per_step = params.get("budget.tokens_per_step", "")
    n_steps = int(steps) if steps.isdigit() else 0
    n_tokens = n_steps * int(tokens_per_step) if tokens_per_step.isdigit() else 0
    tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
    return RunRecord(run_id, run.info.status, dict(params), declared(run.data.metrics), n_steps, n_tokens,
                     run.data.tags.get(CHECKPOINT_TAG), tags)


def fetch_artifact(uri: str, run_id: str, artifact_path: str, dest: Path) -> Path:
    """A local copy of one artifact of MLflow run ``run_id`` (downloaded into ``dest``)."""
    import mlflow.artifacts

    dest.mkdir(parents=True, exist_ok=True)
    try:
        return Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=artifact_path,
                                                        dst_path=str(dest), tracking_uri=uri))
    except Exception as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ModbenchError(f"cannot fetch {artifact_path} of MLflow run {run_id} from {uri}: {first}") from None


def fetch_checkpoint(uri: str, record: RunRecord, dest: Path | None = None) -> Path:
    """A local copy of the record's checkpoint artifact (downloaded into ``dest`` or a temp dir)."""
    if not record.checkpoint:
        raise ModbenchError(f"MLflow run {record.run_id} has no checkpoint artifact (tag {CHECKPOINT_TAG!r}); "
                            "was it trained with tracking on and did it finish?")
    import mlflow.artifacts

    target = Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="modbench-ckpt-"))
    target.mkdir(parents=True, exist_ok=True)
    try:
        local = mlflow.artifacts.download_artifacts(run_id=record.run_id, artifact_path=record.checkpoint,
                                                    dst_path=str(target), tracking_uri=uri)
    except Exception as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ModbenchError(f"cannot fetch the checkpoint of MLflow run {record.run_id} from {uri}: {first}") from None
    return Path(local)
