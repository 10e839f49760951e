"""Typed, strict params: one pydantic model per `params.yaml` section.

Every field is documented where it is declared; an unknown key, a wrong type or an out-of-range value
raises `ConfigError` naming the dotted key and the bad value, e.g.
`federate.inner_steps must be >= 1, got 0`.
"""
from __future__ import annotations

import hashlib
import json
import re
import typing
import zoneinfo
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lensemble.errors import ConfigError


def _numeric_field(annotation: Any) -> bool:
    """Whether a field's type admits int or float but not bool (YAML `true` must not pass as 1)."""
    args = typing.get_args(annotation)
    kinds = set(args) if args else {annotation}
    return bool(kinds & {int, float}) and bool not in kinds


class Section(BaseModel):
    """Base: unknown keys are errors, values are validated on assignment too, and a bool is never a number."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            for name, field in cls.model_fields.items():
                value = raw.get(name)
                if isinstance(value, bool) and _numeric_field(field.annotation):
                    raise ValueError(f"{name} must be a number, got {str(value).lower()} (a boolean)")
                if field.annotation is bool and name in raw and not isinstance(value, bool):
                    raise ValueError(f"{name} must be true or false, got {value!r}")
        return raw


class RunParams(Section):
    seed: int = Field(0, ge=0, description="Root seed; every other seed is derived from it.")
    hardware_class: str = Field("auto", description="Hardware class name, or 'auto' to detect it.")
    torch_threads: int = Field(2, ge=1, le=256, description="torch intra-op threads this job may use in all (its thread budget).")
    workers: int | Literal["auto"] = Field(
        "auto", description="Processes the sites' CPU-bound work (training, baselines, evaluation) is split over, each with "
                            "torch_threads // workers threads; auto: one single-threaded process per thread of the budget; 1: in-process.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where models train and plan: auto takes a CUDA GPU when there is one.")
    deterministic: bool = Field(True, description="Deterministic kernels on CUDA (torch.use_deterministic_algorithms, cuBLAS workspace); CPU kernels are deterministic already.")

    @field_validator("workers")
    @classmethod
    def _positive_workers(cls, v):
        if v != "auto" and v < 1:
            raise ValueError("run.workers must be auto or a positive number of processes")
        return v


class LeRobotSourceParams(Section):
    """A local LeRobot dataset (format v3.0) whose episodes the site imports instead of generating them."""

    lerobot: str = Field(..., min_length=1, description="The dataset's root folder (meta/info.json, data/, videos/), "
                                                        "relative to the project root or absolute.")
    camera: str = Field(..., min_length=1, description="The video or image feature whose frames become the site's frames, "
                                                       "e.g. observation.images.top.")
    state: str = Field("observation.state", min_length=1,
                       description="The feature read as proprioception; its shape must be the embodiment's proprio_dim.")
    action: str = Field("action", min_length=1,
                        description="The feature read as actions; its shape must be the embodiment's action_dim.")


class SiteParams(Section):
    name: str = Field(..., pattern=r"^[a-z][a-z0-9_]{0,31}$", description="Site id, lowercase.")
    embodiment: str = Field(..., description="Embodiment name from lensemble.sim.registry.")
    episodes: int = Field(..., ge=1, le=100_000, description="Episodes generated at this site; with a source, the episodes of "
                                                             "data.episode_length steps cut from the dataset's (the first ones).")
    source: LeRobotSourceParams | None = Field(None, description="Import the site's episodes from a LeRobot dataset "
                                               "(`{lerobot: PATH, camera: KEY}`) instead of generating them; None: the simulator.")
    work_pool: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
                                  description="Prefect work pool the site's training runs on in sovereign mode; None: lensemble-<name>.")
    key_fingerprint: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                                        description="SHA-256 (hex) of the site's raw Ed25519 public key, as `lensemble site keygen SITE` prints it: the key is pinned out of band (INV-PINNED-KEYS). Required for every site in sovereign mode; local runs draw their keys in-process.")

    @property
    def pool(self) -> str:
        """The site's work pool name (sovereign mode)."""
        return self.work_pool or f"lensemble-{self.name.replace('_', '-')}"

    @model_validator(mode="after")
    def _known_embodiment(self) -> "SiteParams":
        from lensemble.sim.registry import EMBODIMENTS

        if self.embodiment not in EMBODIMENTS:
            raise ValueError(f"unknown embodiment {self.embodiment!r}; known: {sorted(EMBODIMENTS)}")
        return self


class DataParams(Section):
    image_size: int = Field(32, ge=16, le=512, description="Frame side in pixels.")
    episode_length: int = Field(32, ge=2, le=10_000, description="Steps per episode.")
    expert_noise: float = Field(0.5, ge=0.0, le=10.0, description="Std of noise on expert actions.")
    random_fraction: float = Field(0.3, ge=0.0, le=1.0, description="Share of random-action segments.")
    segment_length: int = Field(8, ge=1, description="Length of an exploration segment (expert or random).")
    probe_episodes: int = Field(4, ge=1, description="Episodes per embodiment in the public probe set.")
    num_steps: int = Field(4, ge=2, le=64, description="Frames per training Window.")
    sites: tuple[SiteParams, ...] = Field(..., min_length=1, description="The federation's sites.")

    @model_validator(mode="after")
    def _unique_sites(self) -> "DataParams":
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names):
            raise ValueError(f"site names must be unique, got {names}")
        if self.num_steps > self.episode_length:
            raise ValueError(f"num_steps ({self.num_steps}) must be <= episode_length ({self.episode_length})")
        return self


class ModelParams(Section):
    encoder: str = Field("micro", description="ViT config name, a key of VIT_CONFIGS in lensemble/model/sizes.py.")
    patch_size: int = Field(8, ge=1, description="Patch side; must divide data.image_size.")
    predictor_width: int = Field(64, ge=8, description="Predictor transformer width.")
    predictor_depth: int = Field(2, ge=1, le=48, description="Predictor transformer blocks.")
    predictor_heads: int = Field(4, ge=1, description="Predictor attention heads.")
    action_dim: int = Field(32, ge=1, description="d_a, the shared action-embedding width.")
    proprio_dim: int = Field(16, ge=1, le=256, description="Width every embodiment's proprioception is zero-padded to before the federated proprio encoder; >= the largest embodiment's.")
    warm_start: str | None = Field(None, description="Local checkpoint (path) whose encoder weights initialise the encoder; None: random init.")

    @field_validator("encoder")
    @classmethod
    def _known_encoder(cls, name: str) -> str:
        from lensemble.model.sizes import VIT_CONFIGS

        if name not in VIT_CONFIGS:
            raise ValueError(f"unknown ViT config {name!r}; known: {sorted(VIT_CONFIGS)}")
        return name


class ObjectiveParams(Section):
    sigreg_weight: float = Field(0.05, ge=0.0, description="λ_sig.")
    anchor_weight: float = Field(0.1, ge=0.0, description="λ_anc (federated training only).")
    sketch_dim: int = Field(64, ge=1, le=4096, description="SIGReg random directions.")
    sigreg_on: Literal["tokens", "frames", "centered_tokens"] = Field(
        "tokens", description="SIGReg on token embeddings, on per-frame pooled embeddings, or on token embeddings minus their position's batch mean (the layout-free part).")
    sigreg_tokens: int = Field(512, ge=16, description="Token embeddings per step that SIGReg tests (a seeded random subset).")
    num_knots: int = Field(17, ge=3, le=1025, description="Epps-Pulley quadrature points.")
    t_max: float = Field(3.0, gt=0.0, le=20.0, description="Upper end of the quadrature interval.")
    rollout_steps: int = Field(1, ge=0, description="Autoregressive rollout steps in L_pred: the Window's last k steps predicted from the steps before them.")
    proprio_weight: float = Field(1.0, ge=0.0, description="λ_prop: weight of the proprioception prediction error (normalised units).")
    probe_batch: int = Field(4, ge=1, description="Probe frames per step for L_anchor (a small share of the batch keeps the anchor cheap).")
    pred_balance: Literal["none", "copy"] = Field(
        "none", description="One model on several embodiments (Stage A): weigh each embodiment's L_pred by the inverse of its running copy error, the weights averaging 1 (`training.PredBalance`); none: every weight 1. Training on one embodiment is unchanged either way.")


class TrainParams(Section):
    batch_size: int = Field(16, ge=1, description="Windows per inner step.")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="Inner AdamW learning rate.")
    weight_decay: float = Field(0.01, ge=0.0, description="Inner AdamW weight decay.")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="Forward dtype (autocast).")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Inner learning rate over a model's whole training: constant, or linear warm-up then cosine decay to lr_final_fraction x lr (pooled: over centralized.steps; federated and local-only: over rounds x H, each round continuing where the last left off).")
    warmup_steps: int = Field(0, ge=0, description="cosine: linear warm-up steps from lr / warmup_steps to lr.")
    lr_final_fraction: float = Field(0.1, ge=0.0, le=1.0, description="cosine: the learning rate at the last step, as a fraction of lr.")
    freeze_encoder_at: float = Field(1.0, ge=0.0, le=1.0, description="Share of a model's training (pooled: centralized.steps; federated and local-only: rounds x H, as lr_schedule counts) after which the encoder stops learning: later steps train the predictor, proprio layers and action heads against a fixed latent (as DINO-WM and V-JEPA 2-AC predict in a frozen encoder's space). The encoder learns in steps s < round(freeze_encoder_at x total); 1.0: always.")


class CentralizedParams(Section):
    steps: int = Field(400, ge=1, description="Stage A steps on the pooled data.")


class FederateParams(Section):
    rounds: int = Field(4, ge=1, description="DiLoCo outer rounds.")
    inner_steps: int = Field(50, ge=1, description="H, inner AdamW steps per round.")
    outer_lr: float = Field(0.7, gt=0.0, le=10.0, description="Outer Nesterov learning rate.")
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="Outer Nesterov momentum.")
    transport: Literal["fp32", "int8", "secure_int8"] = Field("secure_int8", description="Wire encoding.")
    quant_block: int = Field(4096, ge=16, le=1 << 24, description="int8 quantization block (one absmax scale per block).")
    head_adapt_steps: int = Field(50, ge=0, description="Head-only steps each site takes on the final global model (local; 0 = none).")
    local_only: bool = Field(True, description="Also train each site alone for rounds x H steps: the no-federation baseline evaluate compares against.")
    drop_policy: Literal["continue", "abort"] = Field("continue", description="A site that fails or drops: finish the round with the survivors, or abort.")
    site_timeout_seconds: float = Field(900.0, gt=0.0, description="A site's task (training, or one exchange phase) that runs longer fails with a timeout; the coordinator never waits longer.")
    site_retries: int = Field(1, ge=0, le=10, description="Retries of a failed or timed-out site task before the site counts as dropped for the round.")
    retry_delay_seconds: float = Field(0.0, ge=0.0, le=3600.0, description="Pause before each retry of a site task.")
    task_runner: Literal["threads", "dask"] = Field("threads", description="Where site tasks run: a thread pool, or a Dask cluster (prefect-dask).")
    dask_workers: int = Field(2, ge=1, le=256, description="Dask task runner: workers of the local cluster (one thread each).")
    dask_address: str | None = Field(None, description="Dask task runner: scheduler address of an existing cluster (tcp://host:port); None starts a local one.")
    execution: Literal["local", "sovereign"] = Field("local", description="local: site tasks run in the coordinator's task runner; sovereign: each site's round runs as a deployment on its own work pool, and updates come back through the exchange.")
    site_launch: Literal["deployment", "task"] = Field("deployment", description="Sovereign mode: run each site's round as a deployment on the site's work pool, or (one-machine trial) as a task of the coordinator.")
    exchange: str = Field("exchange", description="Sovereign mode: where sites and coordinator swap round messages; a folder (relative to the project root) or any fsspec URL.")
    update_clip_norm: float | None = Field(None, gt=0.0, description="Per-site L2 clipping of Δ_c over all federated tensors before quantization (bounded influence); None: no clipping. dp.enabled clips at dp.clip_norm instead.")
    announce_outlier_factor: float = Field(4.0, ge=1.0, le=1e6, description="secure_int8 grid agreement: each site's announced block absmax is capped at this factor times the second-largest announcement of the block, so one site cannot coarsen everyone's grid (INV-BOUNDED-INFLUENCE).")


class DPParams(Section):
    enabled: bool = Field(False, description="Site-level differential privacy of the federated update: per-site L2 clipping at clip_norm and distributed Gaussian noise before quantization (lensemble/federation/dp.py).")
    clip_norm: float = Field(1.0, gt=0.0, description="S: L2 bound of each site's Δ_c over all federated tensors.")
    noise_multiplier: float = Field(1.0, gt=0.0, le=1e4, description="z: the aggregate's Gaussian noise std is z · S · max_c w_c.")
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="δ of the reported (ε, δ) guarantee.")


class GaugeParams(Section):
    pair_samples: int = Field(4, ge=0, description="Site pairs sampled per round (never all O(C^2)).")
    collapse_drop_fraction: float = Field(0.5, gt=0.0, lt=1.0, description="Tripwire: effective-dim drop.")


class CemParams(Section):
    samples: int = Field(64, ge=2, description="Action sequences per CEM iteration.")
    elites: int = Field(8, ge=1, description="Elites kept per iteration.")
    iterations: int = Field(3, ge=1, description="CEM iterations per plan.")
    horizon: int = Field(3, ge=1, description="Planned steps.")
    context: int = Field(1, ge=1, description="Observations (frames + proprio) of history the planner starts from; context + horizon <= data.num_steps.")
    execute_steps: int = Field(1, ge=1, description="Planned actions executed before replanning (receding horizon).")

    @model_validator(mode="after")
    def _elites(self) -> "CemParams":
        if self.elites > self.samples:
            raise ValueError(f"elites ({self.elites}) must be <= samples ({self.samples})")
        if self.execute_steps > self.horizon:
            raise ValueError(f"execute_steps ({self.execute_steps}) must be <= horizon ({self.horizon})")
        return self


class EvaluateParams(Section):
    episodes: int = Field(10, ge=1, description="Closed-loop episodes per embodiment and model.")
    max_steps: int = Field(25, ge=1, description="Environment steps per episode.")
    cem: CemParams = Field(default_factory=CemParams)
    success: dict[str, str] = Field(default_factory=dict, description="Success criterion per embodiment (a name from its `success_criteria`); unnamed embodiments use their first.")
    energy: dict[str, Literal["final", "mean"]] = Field(default_factory=dict, description="How the planner reads the energy to the goal over the horizon, per embodiment, for every model and the oracle alike: final: the last planned step's (DINO-WM); mean: averaged over every planned step (reaching the goal early and staying there scores best). Unnamed embodiments use their own (`goal_energy_over`).")


_CRON_ALIASES = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"})
_MONTHS = {name: i + 1 for i, name in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"))}
_DAYS = {name: i for i, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}
# (low, high, names, a whole field allowed besides lists) of minute, hour, day of month, month, day of week (0 and 7: Sunday)
_CRON_FIELDS = ((0, 59, {}, None), (0, 23, {}, None), (1, 31, {}, r"\?|L"), (1, 12, _MONTHS, None), (0, 7, _DAYS, r"\?|[0-7]#[1-5]"))


def _cron_value(text: str, names: dict[str, int]) -> int | None:
    if text.isascii() and text.isdigit():
        return int(text)
    return names.get(text.lower())


def _cron_item(item: str, low: int, high: int, names: dict[str, int]) -> bool:
    """One comma-separated item of a field: `*`, a value or a range `a-b`, each with an optional `/step`."""
    base, slash, step = item.partition("/")
    if slash and not (step.isascii() and step.isdigit() and int(step) > 0):
        return False
    if base == "*":
        return True
    first, dash, last = base.partition("-")
    values = [_cron_value(text, names) for text in ((first, last) if dash else (first,))]
    return all(v is not None and low <= v <= high for v in values) and values == sorted(values)


def valid_cron(expr: str) -> bool:
    """Whether `expr` is a five-field cron schedule (or an alias such as `@hourly`) that Prefect's scheduler accepts.

    Standard cron: lists, ranges, steps, month and weekday names, `?` and `L` in the day of month,
    `?` and `N#k` (k-th weekday N of the month) in the day of week. Prefect's croniter also takes a
    sixth (seconds) field, ranges that wrap (`5-1`, `mon-sun`) and `L` or `#` inside lists or with
    names; those are refused here (tests/test_cron.py holds the two together).
    """
    fields = expr.split()
    if len(fields) == 1:
        return fields[0].lower() in _CRON_ALIASES
    if len(fields) != len(_CRON_FIELDS):
        return False
    for field, (low, high, names, special) in zip(fields, _CRON_FIELDS):
        if special and re.fullmatch(special, field):
            continue
        if not all(_cron_item(item, low, high, names) for item in field.split(",")):
            return False
    return True


class ServeParams(Section):
    cron: str | None = Field(None, description="`lensemble serve`: cron schedule of the federation-rounds deployment (e.g. '0 * * * *'); exclusive with interval_seconds.")
    interval_seconds: float | None = Field(3600.0, gt=0.0, description="`lensemble serve`: interval schedule of the federation-rounds deployment, in seconds.")
    timezone: str = Field("UTC", description="Time zone the cron schedule is read in.")

    @model_validator(mode="after")
    def _one_schedule(self) -> "ServeParams":
        if (self.cron is None) == (self.interval_seconds is None):
            raise ValueError("give exactly one of cron and interval_seconds (set the other to null)")
        known_zone = not self.timezone or self.timezone in zoneinfo.available_timezones()  # as Prefect's CronSchedule checks it
        if self.cron is not None and not (valid_cron(self.cron) and known_zone):
            raise ValueError(f"cron {self.cron!r} in time zone {self.timezone!r} does not parse; five fields, e.g. '0 * * * *'")
        return self


class JoinSiteParams(Section):
    name: str = Field(..., pattern=r"^[a-z][a-z0-9_]{0,31}$", description="Joining site id, lowercase; not one of data.sites.")
    embodiment: str = Field(..., description="Its embodiment: one that took no part in the federation (lensemble.sim.registry).")
    episodes: int = Field(8, ge=1, le=10_000, description="Episodes the site generates and joins with (few: the point of joining).")


class JoinParams(Section):
    """`lensemble join SITE`: a robot that took no part in the federation joins it after the fact."""

    sites: tuple[JoinSiteParams, ...] = Field((), description="Sites that may join after the federation.")
    steps: int = Field(1200, ge=1, le=1_000_000, description="AdamW steps of the joined model's local action head and proprio adapter, and of the from-scratch model.")


class PreflightParams(Section):
    max_cost_usd: float | None = Field(5.0, ge=0.0, description="Refuse a training stage estimated to cost more (USD).")
    max_accelerator_hours: float | None = Field(2.0, ge=0.0, description="Refuse a stage estimated to take longer (hours).")
    max_memory_gib: float | None = Field(16.0, ge=0.0, description="Refuse a step estimated to need more memory (GiB).")
    max_comm_bytes: float | None = Field(1e10, ge=0.0, description="Refuse a federation estimated to move more bytes.")


class Params(Section):
    run: RunParams = Field(default_factory=RunParams)
    data: DataParams
    model: ModelParams = Field(default_factory=ModelParams)
    objective: ObjectiveParams = Field(default_factory=ObjectiveParams)
    train: TrainParams = Field(default_factory=TrainParams)
    centralized: CentralizedParams = Field(default_factory=CentralizedParams)
    federate: FederateParams = Field(default_factory=FederateParams)
    dp: DPParams = Field(default_factory=DPParams)
    gauge: GaugeParams = Field(default_factory=GaugeParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    serve: ServeParams = Field(default_factory=ServeParams)
    preflight: PreflightParams = Field(default_factory=PreflightParams)
    join: JoinParams = Field(default_factory=JoinParams)

    @model_validator(mode="after")
    def _cross_checks(self) -> "Params":
        from lensemble.sim.registry import EMBODIMENTS, embodiment_class

        if self.data.image_size % self.model.patch_size:
            raise ValueError(
                f"model.patch_size ({self.model.patch_size}) must divide data.image_size ({self.data.image_size})"
            )
        if self.model.predictor_width % self.model.predictor_heads:
            raise ValueError(f"model.predictor_heads ({self.model.predictor_heads}) must divide model.predictor_width ({self.model.predictor_width})")
        if self.federate.execution == "sovereign":
            unpinned = [s.name for s in self.data.sites if s.key_fingerprint is None]
            if unpinned:
                raise ValueError(f"data.sites: {unpinned[0]} has no key_fingerprint; sovereign sites' signing keys are pinned out of band "
                                 f"(run `lensemble site keygen {unpinned[0]}` at the site and put the fingerprint it prints in params)")
        federated = {s.embodiment for s in self.data.sites}
        for j in self.join.sites:
            if j.name in {s.name for s in self.data.sites}:
                raise ValueError(f"join.sites: {j.name} is already a federation site (data.sites); a joining site needs a new name")
            if j.embodiment not in EMBODIMENTS:
                raise ValueError(f"join.sites: {j.name} has unknown embodiment {j.embodiment!r}; known: {sorted(EMBODIMENTS)}")
            if j.embodiment in federated:
                raise ValueError(f"join.sites: {j.name}'s embodiment {j.embodiment} took part in the federation; a joining site brings a new one")
        cem = self.evaluate.cem
        if cem.context + cem.horizon > self.data.num_steps:
            raise ValueError(f"evaluate.cem.context ({cem.context}) + evaluate.cem.horizon ({cem.horizon}) exceeds data.num_steps "
                             f"({self.data.num_steps}), the time positions the predictor is trained on; shorten the plan or train longer Windows")
        if self.train.lr_schedule == "cosine":
            shortest = min(self.centralized.steps, self.federate.rounds * self.federate.inner_steps)
            if self.train.warmup_steps >= shortest:
                raise ValueError(f"train.warmup_steps ({self.train.warmup_steps}) must be fewer than the shortest schedule ({shortest} steps: "
                                 "centralized.steps, federate.rounds x federate.inner_steps)")
        if self.objective.rollout_steps >= self.data.num_steps:
            raise ValueError(f"objective.rollout_steps ({self.objective.rollout_steps}) must be < data.num_steps ({self.data.num_steps})")
        used = {s.embodiment for s in self.data.sites}
        for name, criterion in self.evaluate.success.items():
            if name not in EMBODIMENTS:
                raise ValueError(f"evaluate.success: unknown embodiment {name!r}; known: {sorted(EMBODIMENTS)}")
            known = embodiment_class(name).success_criteria
            if criterion not in known:
                raise ValueError(f"evaluate.success.{name}: unknown success criterion {criterion!r}; {name} knows {list(known)}")
        for name in self.evaluate.energy:
            if name not in EMBODIMENTS:
                raise ValueError(f"evaluate.energy: unknown embodiment {name!r}; known: {sorted(EMBODIMENTS)}")
        for name in sorted(used):
            p = embodiment_class(name).proprio_dim
            if p > self.model.proprio_dim:
                raise ValueError(f"model.proprio_dim ({self.model.proprio_dim}) is smaller than {name}'s proprioception ({p})")
        return self

    def hash(self) -> str:
        """sha256 of the canonical JSON of every value, defaults included."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def _format_error(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "params"
    kind, ctx = err["type"], err.get("ctx", {})
    bad = err.get("input")
    if kind == "extra_forbidden":
        return f"unknown key {key}"
    if kind == "missing":
        return f"{key} is required"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"{key} must be {bounds[kind]} {limit}, got {bad!r}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{key}: {msg}, got {bad!r}" if kind != "value_error" else f"{key}: {msg}" if key != "params" else msg


def parse_params(raw: Any) -> Params:
    """Validate a raw mapping; ConfigError naming the first bad key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"params must be a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(_format_error(first)) from None


class DuplicateKey(yaml.YAMLError):
    """A mapping key given twice; the marks are PyYAML's (0-based line and column)."""

    def __init__(self, key: Any, first: yaml.Mark, second: yaml.Mark) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first, self.second = key, first, second


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden key by key
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise DuplicateKey(key, seen[key], key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path, what: str = "params file") -> Any:
    """Parse a user's YAML file; ConfigError naming the file and the 1-based line and column of a syntax error
    or of both places a duplicated key is given."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        return yaml.load(path.read_text(), Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except DuplicateKey as exc:
        raise ConfigError(f"{what} {path}: key {exc.key!r} is given twice, at line {exc.first.line + 1} and at line "
                          f"{exc.second.line + 1}; keep one") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(f"{what} {path} is not valid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {str(exc).splitlines()[0]}") from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate `params.yaml`; ConfigError if missing, unparsable (with line and column), a key is
    duplicated, or a value is invalid."""
    return parse_params(load_yaml(path))
