"""`RunConfig`: one training run, all sections together, with the rules that span sections.

`RunConfig.from_dict` validates strictly (see `typed.build`) and returns the *resolved* config:
every default that depends on another field (per-objective clip widths, protocol refresh interval,
seeds, paths, data-parallel size) is filled in, so the config a run records shows concrete values
and reloading it gives an equal object.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from megapkl.config.local_files import check_local_files  # noqa: F401 - re-exported
from megapkl.config.model_layout import check_model_layout, check_token_budget
from megapkl.config.objective import ObjectiveConfig
from megapkl.config.sections import (AdvantageConfig, ModelConfig, ParallelConfig, ReferenceConfig,
                                     RolloutConfig)
from megapkl.config.sections_env import EnvConfig
from megapkl.config.sections_train import (CheckpointConfig, DataConfig, EvalConfig, LoggingConfig,
                                           RewardConfig, SlurmConfig, TrainConfig)
from megapkl.config.typed import build, rng, to_dict

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class RunConfig:
    """A whole run. Sections follow the data flow of a run: the model and its parallel layout,
    the objective and what feeds it (advantage, reference, rollout), the optimizer, the data and
    reward, then evaluation, logging, checkpoints and the Slurm job."""

    name: str = "megapkl"  # the run's name: its directory, job name and plot label
    description: str = ""  # free text, kept in the resolved config.yaml
    run_dir: Optional[str] = None  # unset: runs/<name>
    # train.seed, data.seed when unset; the engines' sampling
    seed: int = field(default=0, metadata=rng(0))
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn tool use; unset: single-turn
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def check(self, err) -> None:
        """Cross-section rules; `err(message, key, *related_keys)` with dotted keys."""
        if not _NAME.match(self.name):
            err(f"must be a file-name-safe run name (letters, digits, '.', '_', '-'), got "
                f"'{self.name}'", "name")
        for rule in _RULES:
            rule(self, err)

    @property
    def world_size(self) -> Optional[int]:
        """Trainer ranks when the job shape is known: Slurm GPUs minus dedicated SGLang GPUs
        (with `colocate: false` every data-parallel replica has `num_engines x tp` of its own)."""
        total = self.slurm.total_gpus
        if total is None:
            return None
        sg, mp = self.rollout.sglang, self.parallel.model_parallel_size
        if self.rollout.engine != "sglang" or sg.colocate or sg.urls:
            return total
        replicas = self.parallel.data_size(None) or total // (mp + sg.gpus)
        return replicas * mp

    def resolve(self) -> "RunConfig":
        """A copy with every derived default filled in (idempotent)."""
        run_dir = self.run_dir or f"runs/{self.name}"
        ro, ref = self.rollout, self.reference
        sis = self.objective.sis
        topk = ro.topk_logprobs if ro.topk_logprobs is not None else (sis.top_k if self.objective.needs_topk else 0)
        data_size = self.parallel.data_size(self.world_size)
        return dataclasses.replace(
            self,
            run_dir=run_dir,
            objective=self.objective.resolve(),
            parallel=dataclasses.replace(self.parallel, data=data_size or self.parallel.data),
            reference=dataclasses.replace(
                ref, refresh_every=ref.refresh_every if ref.mode == "snapshot" else None,
                kl_init=ref.kl_init if ref.kl_init is not None else self.objective.kl_init_coef > 0),
            rollout=dataclasses.replace(
                ro, refresh_every=ro.effective_refresh_every(),
                max_staleness=ro.effective_max_staleness(), topk_logprobs=topk),
            train=dataclasses.replace(self.train, seed=_or(self.train.seed, self.seed)),
            data=dataclasses.replace(self.data, seed=_or(self.data.seed, self.seed)),
            reward=dataclasses.replace(self.reward, type=self.reward.type or (
                "synthetic" if self.data.synthetic is not None else "math")),
            eval=dataclasses.replace(
                self.eval, benchmarks=list(self.eval.resolved_benchmarks()),
                max_response_len=_or(self.eval.max_response_len, ro.max_response_len)),
            checkpoint=dataclasses.replace(
                self.checkpoint, dir=self.checkpoint.dir or f"{run_dir}/checkpoints"),
            slurm=dataclasses.replace(self.slurm, job_name=self.slurm.job_name or self.name),
        )

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any] | None = None, *,
                  source: str = "<dict>") -> "RunConfig":
        """Strictly validated, resolved config from a plain mapping (e.g. merged YAML)."""
        return build(cls, dict(mapping or {}), source=source).resolve()

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# ---- cross-section rules (each names the dotted key to fix first, then the keys it conflicts with)

def _check_world(cfg: RunConfig, err) -> None:
    par, world = cfg.parallel, cfg.world_size
    if world is None:
        return
    where = f"slurm.nodes x slurm.gpus_per_node = {cfg.slurm.nodes} x {cfg.slurm.gpus_per_node}"
    mp = f"{par.tensor} x {par.pipeline} x {par.context}"
    if world != cfg.slurm.total_gpus:
        where += f" minus {cfg.slurm.total_gpus - world} dedicated SGLang GPUs"
    if world < 1:
        err(f"no GPUs left for the trainer ({where})", "rollout.sglang.num_engines",
            "slurm.nodes", "slurm.gpus_per_node")
    sg = cfg.rollout.sglang
    dedicated = cfg.rollout.engine == "sglang" and not sg.colocate and not sg.urls
    if dedicated and world // par.model_parallel_size * sg.gpus + world != cfg.slurm.total_gpus:
        err(f"{world // par.model_parallel_size} data-parallel replicas x (trainer {mp} + "
            f"dedicated SGLang num_engines x tp = {sg.num_engines} x {sg.tp}) GPUs do not add "
            f"up to slurm.nodes x slurm.gpus_per_node = {cfg.slurm.total_gpus}",
            "rollout.sglang.num_engines", "parallel.data", "slurm.nodes")
    if isinstance(par.data, int):
        if par.data * par.model_parallel_size != world:
            err(f"data x tensor x pipeline x context = {par.data} x {mp} = "
                f"{par.data * par.model_parallel_size} must equal the trainer world size {world} "
                f"({where})", "parallel.data", "slurm.nodes", "slurm.gpus_per_node")
    elif world % par.model_parallel_size:
        err(f"the trainer world size {world} ({where}) is not divisible by tensor x pipeline x "
            f"context = {mp}", "parallel.data", "parallel.tensor", "slurm.gpus_per_node")


def _check_moe(cfg: RunConfig, err) -> None:
    par, model = cfg.parallel, cfg.model
    if par.expert > 1 and not model.is_moe:
        err(f"expert parallelism needs a mixture-of-experts model; '{model.name}' is dense",
            "parallel.expert", "model.name")
    if cfg.rollout.engine == "sglang" and cfg.rollout.sglang.ep > 1 and not model.is_moe:
        err(f"expert parallelism needs a mixture-of-experts model; '{model.name}' is dense",
            "rollout.sglang.ep", "model.name")
    data = par.data_size(cfg.world_size)
    if par.expert > 1 and data is not None and (data * par.context) % par.expert:
        err(f"must divide data x context = {data} x {par.context} (megatron-core places experts "
            f"over the data and context ranks)", "parallel.expert", "parallel.data")


def _check_layers(cfg: RunConfig, err) -> None:
    layers, par = cfg.model.num_layers, cfg.parallel
    stages = par.pipeline * (par.virtual_pipeline or 1)
    if layers is not None and layers % stages:
        err(f"{layers} layers cannot be split evenly over pipeline x virtual_pipeline = {stages} "
            "stages", "parallel.pipeline", "model.num_layers")


def _check_batch(cfg: RunConfig, err) -> None:
    ro, par = cfg.rollout, cfg.parallel
    data = par.data_size(cfg.world_size)
    if par.max_tokens_per_micro_batch is not None:
        _check_token_budget(cfg, data, err)
        return
    if data is None:
        return
    per_step = data * par.micro_batch_size
    if ro.responses_per_minibatch % per_step:
        err(f"an optimizer minibatch of {ro.responses_per_minibatch} responses (prompts_per_batch x "
            f"responses_per_prompt / minibatches_per_batch) does not split into data ({data}) x "
            f"micro_batch_size ({par.micro_batch_size}) equal parts", "parallel.micro_batch_size",
            "rollout.prompts_per_batch", "parallel.data")


def _check_token_budget(cfg: RunConfig, data: Optional[int], err) -> None:
    ro, par = cfg.rollout, cfg.parallel
    mult = par.sequence_multiple
    longest = -(-(ro.max_prompt_len + ro.max_response_len) // mult) * mult
    if par.max_tokens_per_micro_batch < longest:
        err(f"a token budget of {par.max_tokens_per_micro_batch} cannot hold the longest response: "
            f"rollout.max_prompt_len + max_response_len = {ro.max_prompt_len + ro.max_response_len}"
            f" tokens, padded to {longest} (multiple of {mult})", "parallel.max_tokens_per_micro_batch",
            "rollout.max_response_len")
    if data is not None and ro.responses_per_minibatch % data:
        err(f"an optimizer minibatch of {ro.responses_per_minibatch} responses does not split over "
            f"data = {data} ranks", "parallel.data", "rollout.prompts_per_batch")


def _check_advantage(cfg: RunConfig, err) -> None:
    g, adv = cfg.rollout.responses_per_prompt, cfg.advantage
    if adv.mode in ("group_mean", "group_std") and g < 2:
        err(f"advantage.mode {adv.mode} compares the responses of a prompt and needs "
            f"responses_per_prompt >= 2, got {g}", "rollout.responses_per_prompt", "advantage.mode")
    if adv.filter_constant_groups and g < 2:
        err("dynamic sampling drops groups with equal rewards: every group of one response is "
            "constant; needs rollout.responses_per_prompt >= 2", "advantage.filter_constant_groups",
            "rollout.responses_per_prompt")


def _check_reference(cfg: RunConfig, err) -> None:
    if cfg.reference.kl_init is False and cfg.objective.kl_init_coef > 0:
        err(f"objective.kl_init_coef = {cfg.objective.kl_init_coef} needs the initial model; set "
            "reference.kl_init: true (or leave it unset)", "reference.kl_init",
            "objective.kl_init_coef")


def _check_sis(cfg: RunConfig, err) -> None:
    sis, k = cfg.objective.sis, cfg.rollout.topk_logprobs
    if cfg.objective.name == "dppo_tv" and k == 0:
        err("dppo_tv compares the policies on the behavior top-K log-probs; set "
            "rollout.topk_logprobs > 0 (unset: objective.sis.top_k)", "rollout.topk_logprobs")
    if sis.enabled and k is not None and k < sis.top_k:
        err(f"SIS with top_k {sis.top_k} needs the rollout to record at least that many behavior "
            f"log-probs per token, got topk_logprobs={k}", "rollout.topk_logprobs",
            "objective.sis.top_k")


def _check_reward(cfg: RunConfig, err) -> None:
    kind, data = cfg.reward.type, cfg.data
    if kind == "math" and data.synthetic is not None:
        err(f"reward type math scores boxed answers of a dataset, but data.synthetic is "
            f"'{data.synthetic}'; use reward.type: synthetic", "reward.type", "data.synthetic")
    if kind == "synthetic" and data.synthetic is None:
        err("reward type synthetic needs data.synthetic (a synthetic task name)", "reward.type",
            "data.synthetic")


def _check_eval(cfg: RunConfig, err) -> None:
    for i, b in enumerate(cfg.eval.resolved_benchmarks()):
        if b.greedy and b.n_samples != 1:
            err(f"greedy decoding gives one distinct answer, but benchmark '{b.name}' asks for "
                f"{b.n_samples} samples (set its n_samples: 1 or greedy: false)",
                f"eval.benchmarks[{i}]", "eval.greedy", "eval.n_samples")


def _check_dtype(cfg: RunConfig, err) -> None:
    from megapkl.config.sections import bf16_constraint_error

    problem = cfg.model.dtype == "bf16" and bf16_constraint_error(cfg.slurm.constraint)
    if problem:
        err(problem, "model.dtype", "slurm.constraint")


def _check_env(cfg: RunConfig, err) -> None:
    env = cfg.env
    if env.type == "lookup" and cfg.data.synthetic != "lookup_kv":
        err(f"env type lookup answers the synthetic task lookup_kv; data.synthetic is "
            f"{cfg.data.synthetic!r}", "env.type", "data.synthetic")
    if cfg.data.synthetic == "lookup_kv" and env.type != "lookup":
        err("the synthetic task lookup_kv is answered with its tool: set env.type: lookup",
            "data.synthetic", "env.type")
    if env.multi_turn and env.max_turn_tokens is not None \
            and env.max_turn_tokens > cfg.rollout.max_response_len:
        err(f"one turn ({env.max_turn_tokens} tokens) cannot exceed the response budget "
            f"rollout.max_response_len ({cfg.rollout.max_response_len})", "env.max_turn_tokens",
            "rollout.max_response_len")


_RULES = (_check_world, _check_moe, _check_layers, _check_batch, _check_advantage,
          _check_reference, _check_sis, _check_reward, _check_env, _check_eval, _check_dtype,
          check_model_layout, check_token_budget)
