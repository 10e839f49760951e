"""Each site's episode store (and the public probe) as an MLflow dataset: digest and source, never rows.

`log_site_datasets(client, run_id, manifests)` turns the data manifests a stage already holds
(counts and hashes only) into `mlflow.entities.Dataset` inputs of the stage's run:
name = site id (or `public_probe/<embodiment>`), digest = the store's content hash truncated to
MLflow's 36 characters, source_type "local", source = {"uri": absolute path of the Parquet store},
schema = the schema hash and column types, profile = the counts. No value of any row is read.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE

from lensemble.data.episodes import SCHEMA
from lensemble.paths import Layout
from orchestration.tracking import patient

CONTEXT_TAG = "mlflow.data.context"  # MLflow's own tag: the role of a dataset in the run


def dataset_entity(name: str, manifest: Mapping, store: Path) -> Dataset:
    """The MLflow dataset of one store, from its manifest (counts and hashes) and path."""
    schema = {"schema_hash": manifest["schema_hash"], "columns": {f.name: str(f.type) for f in SCHEMA}}
    profile = {k: manifest[k] for k in ("embodiment", "episodes", "steps") if k in manifest}
    return Dataset(
        name=name,
        digest=manifest["content_hash"][:MAX_DATASET_DIGEST_SIZE],
        source_type="local",
        source=json.dumps({"uri": str(Path(store).resolve())}),
        schema=json.dumps(schema, sort_keys=True),
        profile=json.dumps(profile, sort_keys=True),
    )


def site_dataset_inputs(manifests: Mapping[str, Mapping], root: Path | str = ".") -> list[DatasetInput]:
    """Dataset inputs for every site manifest (context "training") and every public probe ("probe").

    `manifests` is a stage's `data_manifests`: site id → manifest, plus "public_probe" →
    {embodiment → manifest}; entries without a content hash are skipped.
    """
    layout = Layout(Path(root))
    inputs = []
    for site in sorted(manifests):
        m = manifests[site]
        if site == "public_probe":
            for emb in sorted(m):
                if "content_hash" in m[emb]:
                    ds = dataset_entity(f"public_probe/{emb}", m[emb], layout.probe(emb))
                    inputs.append(DatasetInput(ds, tags=[InputTag(CONTEXT_TAG, "probe")]))
        elif "content_hash" in m:
            ds = dataset_entity(site, m, layout.site_episodes(site))
            inputs.append(DatasetInput(ds, tags=[InputTag(CONTEXT_TAG, "training")]))
    return inputs


def log_site_datasets(client: MlflowClient, run_id: str, manifests: Mapping[str, Mapping], root: Path | str = ".") -> int:
    """Record every site's store (and the public probe) as dataset inputs of `run_id`; returns the count."""
    inputs = site_dataset_inputs(manifests, root)
    if inputs:
        patient(lambda: client.log_inputs(run_id, datasets=inputs))
    return len(inputs)
