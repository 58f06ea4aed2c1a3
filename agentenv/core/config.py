"""Run configuration: plain YAML presets in ``configs/`` validated into typed objects.

Contract:

* A preset is a YAML mapping with the sections of :class:`RunConfig` (``env``, ``model``, ``rollout``, ``algo``,
  ``loop``, ``eval``, ``sft``, ``run``, ``launch``) and an optional ``variants:`` mapping ``name -> overrides``
  (a nested mapping merged on top of the preset). Every field has a default, so a preset states only what it sets.
* :func:`load_config(preset, variants, overrides)` = preset, then each variant in order, then ``--set`` overrides
  (``"a.b=value"``; the value is parsed as YAML, so ``1e-3``, ``true``, ``[1, 2]``, ``null`` work), then validation.
* ``algo.loss`` is a tagged section (a pydantic discriminated union, :data:`LossConfig`): ``type`` names the loss
  and the other keys are that loss's options (``{type: flashreinforce, delta: 1.0e-3}``, ``{type: grpo, clip_eps:
  0.2}``); a bare name is that loss with its defaults. A variant or ``--set`` that changes ``type`` starts the
  section afresh (the old loss's options do not carry over). The keys that moved into it (``algo.delta``, ...) fail
  with one line naming their new place.
* Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` whose message names the dotted path
  and, for unknown keys, the valid ones. An unknown variant lists the preset's variants.
* Finding, reading and merging preset files is :mod:`agentenv.core.presets` (its names are re-exported here).

Pure data: nothing here builds models or envs (that is :mod:`agentenv.run.train`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .presets import (  # noqa: F401  (re-exported: the config's public names are imported from here)
    ConfigError, apply_override, config_dirs, deep_merge, find_preset, list_presets, parse_override, preset_variants,
    read_yaml)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EnvConfig(_Section):
    id: str = "python"  # alias (alfworld, python, guess) or a gymnasium id
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to gymnasium.make for training episodes
    train_split: Optional[str] = None  # for envs with splits (alfworld: train)
    tasks: Literal["env", "demo"] = "env"  # "demo": the built-in multiplication task set of agentenv.run.demo
    num_tasks: int = Field(256, ge=1)  # prompts per epoch (task_index 0..n-1, or seeds for envs without tasks)
    # tasks=demo only: this share of the questions is asked as "A * 100", which the no-tool guess answers right (the
    # ablations' task family: answering without the tool is sometimes rewarded); 0 = the demo itself
    demo_easy_fraction: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _demo_only(self):
        if self.demo_easy_fraction and self.tasks != "demo":
            raise ValueError("demo_easy_fraction shapes the demo's question set: it needs env.tasks=demo")
        return self


class ModelConfig(_Section):
    name: str = "tiny"  # "tiny", "tiny:HxL", a local checkpoint dir, an alias (qwen2.5-7b) or a hub id
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Optional[str] = None  # None: cuda if available, else cpu
    backend: Literal["hf", "vllm"] = "hf"  # rollout sampler
    gradient_checkpointing: bool = False
    # dtype of the saved model directories (RUN/final_model, checkpoints' model/): None = the compute dtype (bf16
    # on a GPU with dtype auto: half the bytes of fp32, what vLLM serves), "float32" keeps the master precision
    save_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None


class RolloutSection(_Section):
    max_turns: int = Field(10, ge=1)
    max_total_tokens: int = Field(8192, ge=16)  # whole trajectory (prompt + all turns)
    max_generated_tokens: Optional[int] = Field(None, ge=1)  # policy tokens per trajectory; None = no extra cap
    max_new_tokens: int = Field(1024, ge=1)  # per assistant turn
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)


class LossSection(_Section):
    """A loss's typed options: ``type`` names the loss (its tag in :data:`LossConfig`); the fields are its options.
    :func:`agentenv.trainer.losses.register_loss` binds a section class to the loss's compute function."""

    type: str


class FlashReinforceLoss(LossSection):
    """The FlashREINFORCE objective (``agentenv.trainer.objectives.flashreinforce_loss``) and the paper's ablations."""

    type: Literal["flashreinforce"] = "flashreinforce"
    delta: float = Field(1e-3, ge=0)  # sequence trust threshold; .inf allowed
    no_trust: bool = False  # ablation: delta = inf
    no_is: bool = False  # ablation: ratio 1 and no gate
    token_mean: bool = False  # ablation: 1 / sum_j T_j instead of 1 / (B T_i)
    negative_token_fraction: float = Field(1.0, ge=0, le=1)  # failure filter q (1.0 = off)
    # ablation "constant_length": each trajectory's token sum is divided by this constant instead of its own length
    constant_length: Optional[int] = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_normalisation(self):
        if self.token_mean and self.constant_length is not None:
            raise ValueError("token_mean and constant_length are two different normalisations: choose one")
        return self


class GRPOLoss(LossSection):
    """The GRPO baseline: group-mean advantages, PPO-clipped token mean (``objectives.grpo_loss``)."""

    type: Literal["grpo"] = "grpo"
    clip_eps: float = Field(0.2, gt=0)


# `algo.loss` is one of these, chosen by its `type` (a missing type means the default loss, flashreinforce; a bare
# name is shorthand for that loss with its defaults: `--set algo.loss=grpo`)
LossConfig = Annotated[Union[FlashReinforceLoss, GRPOLoss], Field(discriminator="type")]

# algo keys that became a loss's options: an old preset or --set fails with the new key's name
MOVED_ALGO_KEYS = {k: f"algo.loss.{k}" for k in ("delta", "no_trust", "no_is", "token_mean", "negative_token_fraction",
                                                  "constant_length")}
MOVED_ALGO_KEYS["grpo_clip_eps"] = "algo.loss.clip_eps (with algo.loss.type=grpo)"


class AlgoConfig(_Section):
    loss: LossConfig = Field(default_factory=FlashReinforceLoss)
    lr: float = Field(1e-6, gt=0)
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_ratio: float = Field(0.03, ge=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.1, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    # AdamW's epsilon: a coordinate whose gradient stays far below it moves less than lr per step (Adam moves every
    # coordinate ~lr, however small its gradient, when eps is negligible)
    eps: float = Field(1e-8, gt=0)
    # AdamW's (beta1, beta2), each in [0, 1)
    betas: tuple[float, float] = (0.9, 0.999)
    # tail averaging: the run's final weights (final evaluation, final_model) are the uniform mean of the weights
    # after each of the last N updates (all of them when the run is shorter, e.g. a smoke); 0 = the last update's
    # weights. Rollouts always sample the current weights.
    average_last_updates: int = Field(0, ge=0)
    max_tokens_per_microbatch: Optional[int] = Field(None, ge=1)
    # top-k / top-p < 1 make mu != pi even at lag 0; the run refuses settings whose lag-0 gate would reject
    # (almost) everything unless this is set
    allow_truncated_sampling: bool = False
    # a control, not a method: each batch's rewards are shuffled among its trajectories (seeded by loop.seed and the
    # update) before advantages, so RL sees the same rewards with no link to behaviour; metrics say rewards_permuted
    permute_rewards: bool = False

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v):
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each of AdamW's betas must be in [0, 1), got {list(v)}")
        return v

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_shorthand(cls, v):
        if isinstance(v, str):
            return {"type": v}
        if isinstance(v, dict) and "type" not in v:
            return {"type": "flashreinforce", **v}
        return v


class LoopConfig(_Section):
    mode: Literal["async", "sync_grpo"] = "async"
    backend: Literal["local", "ray"] = "local"
    batch_size: int = Field(64, ge=1)  # trajectories per update (prompts x samples)
    group_size: int = Field(1, ge=1)  # samples per prompt (1 = FlashREINFORCE single rollout)
    queue_size: int = Field(2, ge=1)
    max_staleness: Optional[int] = Field(None, ge=0)
    num_workers: int = Field(2, ge=1)
    concurrency: int = Field(8, ge=1)  # episodes in flight per worker
    total_updates: int = Field(200, ge=1)
    episode_timeout_s: float = Field(600.0, gt=0)  # wall-clock limit per episode; longer ones are abandoned, counted
    checkpoint_every: int = Field(0, ge=0)  # updates between checkpoints (0 = only when the run stops)
    keep_checkpoints: int = Field(2, ge=1)  # the newest N loop checkpoints (and step_N/model dirs) are kept
    restart_workers: bool = True  # replace a crashed rollout worker (else run on with fewer)
    poll_interval_s: float = Field(0.02, gt=0)  # how long the loop waits for worker events per iteration
    seed: int = 0  # prompt order
    # a benchmark harness, not a training setting: samplers hold the weights exactly this many versions behind the
    # learner (the starting weights until then), so the trust gate and importance sampling meet a known lag;
    # needs mode=sync_grpo, whose barrier keeps one weight version per batch. 0 = the latest weights.
    fixed_lag: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _groups(self):
        if self.fixed_lag and self.mode != "sync_grpo":
            raise ValueError(f"fixed_lag={self.fixed_lag} needs loop.mode=sync_grpo (async batches mix versions, so "
                             "their lag is not fixed)")
        if self.mode == "sync_grpo" and self.batch_size % self.group_size:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of group_size {self.group_size}")
        if self.mode == "async" and self.group_size != 1:
            raise ValueError("group_size > 1 needs loop.mode=sync_grpo (async FlashREINFORCE is one rollout per prompt)")
        return self


class EvalConfig(_Section):
    every: int = Field(0, ge=0)  # updates between evaluations (0 = only --eval-only / end of run if at_end)
    at_start: bool = False  # evaluate the starting (warm-started) policy before the first update
    at_end: bool = False
    splits: list[str] = Field(default_factory=list)  # e.g. [valid_seen, valid_unseen]; [] = the training tasks
    episodes: Optional[int] = Field(None, ge=1)  # tasks per split; None = the whole split
    # plays per task: one number for every split, or one per split, e.g. {valid_seen: 2, valid_unseen: 8} (spend the
    # episodes where the interval matters); with a mapping every evaluated split must be named ("train_tasks" for
    # an evaluation on the training tasks)
    samples: Union[int, dict[str, int]] = 1
    temperature: Optional[float] = Field(None, gt=0)  # None = the rollout temperature
    top_p: Optional[float] = Field(None, gt=0, le=1)  # None = the rollout top_p
    # Seeds each play's draws from (seed, split, task, play, turn): the same weights score the same whatever the
    # batching, and every evaluation of a run meets the same random numbers. None = unseeded draws.
    seed: Optional[int] = 0
    # Evaluate with this many copies of the transformers sampler at once, each on its own thread with an even share
    # of the torch threads: a small model's decode step does not keep 2 threads busy, two 1-thread samplers do
    # (ALFWorld demo on 2 cores: 1.3x the episodes per second). Each copy holds the weights once more. hf only.
    samplers: int = Field(1, ge=1)

    @field_validator("samples")
    @classmethod
    def _positive_samples(cls, v):
        if any(n < 1 for n in (v.values() if isinstance(v, dict) else [v])):
            raise ValueError(f"plays per task must be >= 1, got {v}")
        return v

    def samples_for(self, split: Optional[str]) -> int:
        """Plays per task of ``split`` (None: the training tasks, named "train_tasks" in a per-split mapping)."""
        if isinstance(self.samples, int):
            return self.samples
        key = split or "train_tasks"
        if key not in self.samples:
            raise ConfigError(f"eval.samples names no plays for split {key!r} (it names {sorted(self.samples)})")
        return self.samples[key]


class SFTSection(_Section):
    enabled: bool = False  # warm-start by SFT before RL
    # "scripted" (agentenv.run.demo's tool demos), "expert" (the env's scripted expert plays num_demos training tasks
    # through the runtime at the start of the run) or a trajectories JSONL path (e.g. `agentenv rollout` output)
    demos: str = "scripted"
    num_demos: int = Field(1000, ge=1)
    expert_noise: float = Field(0.0, ge=0, lt=1)  # demos: "expert": share of turns the expert plays a random action
    tool_fraction: float = Field(0.25, ge=0, le=1)  # scripted demos: share that use the tool
    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-4, gt=0)
    schedule: Literal["constant", "cosine"] = "constant"  # lr after warmup (cosine: down to lr / 10 at the end)
    batch_size: int = Field(16, ge=1)
    # > 0: SFT also predicts the prompt/observation tokens with this weight (agentenv.run.sft: for a model trained from
    # scratch, language-model signal on the env's own text; 0 = the usual loss on the assistant's tokens only)
    context_loss_weight: float = Field(0.0, ge=0)
    # False: imitate every demo, won or lost -- right for a player whose lost plays act as well as its won ones (a
    # blind searcher that ran out of turns); True keeps only won demos (imitating a failure teaches failing)
    only_successful: bool = True
    # demos kept out of training to measure it: the NLL per action token on them, per demo kind, after each epoch
    # (scripted demos: fresh questions from the held-out side of the demo's question space; else a random share)
    heldout_demos: int = Field(64, ge=0)


class RunSection(_Section):
    name: str = "run"
    dir: Optional[str] = None  # None: runs/{name}-{YYYYmmdd-HHMMSS}
    tensorboard: bool = True
    wandb: bool = False  # used only when the wandb package is installed
    plot: bool = True  # PNG curves at the end of the run
    collapse_window: int = Field(20, ge=2)  # updates over which the tool-call peak is tracked
    collapse_ratio: float = Field(0.3, gt=0, lt=1)  # warn when the tool rate falls below this x its recent peak
    no_learning_updates: int = Field(5, ge=1)  # warn once after this many updates in a row that cannot learn
    save_trajectories: bool = True
    threads: Optional[int] = Field(None, ge=1)  # torch CPU threads


class LaunchConfig(_Section):
    """Where the run's parts go: printed by --dry-run as the launch plan, and what the run starts."""

    gpus: int = Field(0, ge=0)  # GPUs the plan needs (learner ranks + engines; colocated: 1); the run stops with fewer
    # model.backend=vllm: the number of engines; with loop.backend=ray it sets loop.num_workers (one engine per
    # rollout actor); 0 = one per rollout worker (ray) / one (local)
    vllm_engines: int = Field(0, ge=0)
    vllm_tensor_parallel: int = Field(1, ge=1)
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, lt=1)  # engine's share of its GPU (colocated: < 1)
    vllm_sleep: bool = True  # colocated engine releases its KV cache during the learner step (vLLM sleep mode)
    # how a Ray run's weights reach its vLLM engines (vLLM's weight-transfer API; agentenv.samplers.weight_transfer):
    # auto = gloo on CPU, CUDA IPC when the engine shares the learner's GPU, NCCL when engines are on other GPUs;
    # object_store = one ray.put of the state dict per update (the fallback, only when named). Recorded in
    # summary.json components.weight_sync.transport. A local run loads its one in-process engine directly.
    weight_transfer: Literal["auto", "gloo", "nccl", "ipc", "object_store"] = "auto"
    learner_world_size: int = Field(1, ge=1)  # > 1: FSDP2 learner ranks (gloo on CPU, NCCL on GPU)
    ray_address: Optional[str] = None  # None: start a local Ray cluster (loop.backend=ray)
    ray_num_cpus: Optional[int] = Field(None, ge=1)  # CPUs of that local cluster; None = what the plan needs
    ray_num_gpus: Optional[int] = Field(None, ge=0)  # GPUs that local cluster declares; None = the visible ones
    gpu_memory_gb: Optional[float] = Field(None, gt=0)  # memory per GPU for preflight; None = the visible GPUs'
    # Ray placement of the learner ranks' bundles: PACK (fewest nodes, NVLink) / SPREAD / STRICT_SPREAD (one per node)
    learner_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    worker_num_cpus: float = Field(1.0, ge=0)  # Ray resources per rollout actor
    worker_num_gpus: float = Field(0.0, ge=0)  # e.g. 1 per vLLM engine actor on a GPU cluster


class RunConfig(_Section):
    preset: str = ""
    description: str = ""
    env: EnvConfig = Field(default_factory=EnvConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTSection = Field(default_factory=SFTSection)
    run: RunSection = Field(default_factory=RunSection)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    variants: list[str] = Field(default_factory=list)  # applied variants (recorded, not an input)

    @field_validator("variants", mode="before")
    @classmethod
    def _no_mapping(cls, v):
        if isinstance(v, dict):
            raise ValueError("internal: variants must be applied before validation")
        return v

    @model_validator(mode="after")
    def _across_sections(self):
        if "max_turns" in self.env.kwargs:
            raise ValueError("env.kwargs.max_turns: the turn limit is rollout.max_turns (one limit for the runtime and "
                             "the env); set that instead")
        if self.model.backend == "vllm":
            if self.loop.backend == "ray" and self.launch.vllm_engines:
                self.loop.num_workers = self.launch.vllm_engines  # one engine per rollout actor
            elif self.launch.vllm_engines > 1:
                raise ValueError(f"launch.vllm_engines={self.launch.vllm_engines}: loop.backend=local runs one "
                                 "in-process engine; set loop.backend=ray for more, or launch.vllm_engines=1")
        elif self.launch.vllm_engines:
            raise ValueError("launch.vllm_engines > 0 needs model.backend=vllm")
        if self.eval.samplers > 1 and self.model.backend != "hf":
            raise ValueError(f"eval.samplers={self.eval.samplers} copies the transformers sampler (model.backend=hf); "
                             f"a {self.model.backend} engine batches an evaluation on its own: set eval.samplers=1")
        if self.loop.fixed_lag and self.eval.every:
            raise ValueError("loop.fixed_lag with eval.every: a mid-run evaluation loads the learner's current weights "
                             "into the lagged sampler; evaluate at the end (eval.at_end) instead")
        if isinstance(self.eval.samples, dict):
            missing = [s for s in (self.eval.splits or ["train_tasks"]) if s not in self.eval.samples]
            if missing:
                raise ValueError(f"eval.samples: a per-split mapping must name every evaluated split; "
                                 f"it lacks {missing}")
        return self

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def _format_errors(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(_section_for(err["loc"])[1]) or "(top level)"
        if err["type"] == "extra_forbidden":
            section = _section_for(err["loc"][:-1])[0]
            valid = ", ".join(section.model_fields) if section is not None else "?"
            lines.append(f"  {loc}: unknown key (valid keys here: {valid})")
        else:
            lines.append(f"  {loc}: {err['msg']} (got {err.get('input')!r})")
    return "invalid config:\n" + "\n".join(lines)


def _section_for(loc: tuple) -> tuple[type[BaseModel] | None, tuple[str, ...]]:
    """The section model at ``loc`` and the dotted key a user writes for it. Pydantic puts a tagged union's tag in
    the location (``algo.loss.grpo.x``); it picks the member and is not part of the key (``algo.loss.x``)."""
    model: type[BaseModel] | dict | None = RunConfig
    key: list[str] = []
    for part in map(str, loc):
        if isinstance(model, dict):  # {tag: member} of a tagged union
            model = model.get(part)
            continue
        key.append(part)
        field = model.model_fields.get(part) if model is not None else None
        ann = field.annotation if field is not None else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        elif field is not None and field.discriminator:
            model = {m.model_fields[field.discriminator].default: m for m in ann.__args__}
        else:
            model = None
    return (None if isinstance(model, dict) else model), tuple(key)


def validate(data: dict) -> RunConfig:
    moved = [k for k in (data.get("algo") or {}) if k in MOVED_ALGO_KEYS] if isinstance(data.get("algo"), dict) else []
    if moved:
        raise ConfigError(f"algo.{moved[0]} is now {MOVED_ALGO_KEYS[moved[0]]}: a loss's options live in its "
                          "section algo.loss (e.g. algo: {loss: {type: flashreinforce, delta: 1.0e-3}})")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def load_config(preset: str | Path | dict = "demo", variants: list[str] | tuple = (), overrides: list[str] | tuple = (),
                ) -> RunConfig:
    if isinstance(preset, dict):
        data, name = copy.deepcopy(preset), str(preset.get("preset", "custom"))
    else:
        path = find_preset(str(preset))
        data, name = read_yaml(path), path.stem
    available = data.pop("variants", None) or {}
    recorded: list = []
    if isinstance(available, list):  # a resolved config (run_dir/config.yaml) records the variants it applied
        recorded, available = [str(v) for v in available], {}
    if not isinstance(available, dict):
        raise ConfigError(f"preset {name}: 'variants' must be a mapping name -> overrides")
    for v in variants:
        if v not in available:
            raise ConfigError(f"preset {name} has no variant {v!r}. Variants: {', '.join(available) or '(none)'}")
        over = available[v] or {}
        if not isinstance(over, dict):
            raise ConfigError(f"preset {name}: variant {v!r} must be a mapping of overrides")
        data = deep_merge(data, over)
    for item in overrides:
        path, value = parse_override(item)
        apply_override(data, path, value)
    data.setdefault("preset", name)
    data["variants"] = recorded + list(variants)
    return validate(data)
