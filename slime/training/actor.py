"""TrainActor: one data-parallel rank; backend-agnostic RL step over micro-batches.

Per rollout (`train`, role "actor"):
  1. reference log-probs (frozen initial weights) when the KL loss or KL-in-reward is on;
  2. old log-probs: the engine's with `--use-rollout-logprobs`; else, with one step per
     rollout (and no KL-in-reward), the detached log-probs of the training forward itself
     (ratio exactly 1); otherwise a no-grad pass before any update;
  3. advantages via `ADVANTAGE_ESTIMATORS[args.advantage_estimator]` (or
     `--custom-advantage-function-path`), from rewards, KL(old || ref) when
     `--kl-coef` > 0 and the critic's values (PPO); optionally whitened over all ranks;
  4. the optimizer steps (`_run_steps`), per-token loss = policy loss
     (`policy_loss_for(args)`: ppo / gspo / cispo / sapo, or `--custom-loss-function-path`, on one
     `LossInputs` record), weighted by importance sampling against the engine's log-probs
     (`--use-tis`, `--tis-mode`), masked by OPSM and the top-entropy tokens (slime.algorithms.off_policy),
     + kl_loss_coef * KL (importance-weighted with `--use-unbiased-kl`) - entropy_coef * entropy;
     MoE models replay the engine's or the old policy's experts (slime.training.moe).
`--loss-type sft_loss` trains the negative log-likelihood of the loss-mask tokens instead
(`_train_sft`). Role "critic" (PPO) is a value model: `compute_values` before the actor's
advantages, then `train_critic` on the actor's returns with the clipped value loss.

The three share one step loop (`_run_steps`): the rank's samples split in order into
`--num-steps-per-rollout` steps; each step into micro-batches of `--micro-batch-size` samples
(or, with `--use-dynamic-batch-size`, of up to `--max-tokens-per-gpu` tokens); per-token weights
that depend only on the sample and the global step (`--loss-agg-mode`), times dp_size to undo the
backends' gradient averaging; one `TrainBackend.train_step` (grad clip, optimizer step). A role
supplies only its per-token loss and the per-token values it logs. Metrics are loss-token means
within a step (all ranks), averaged over steps, and identical on every rank.

The backend (`BACKENDS[args.train_backend]`) implements `slime.training.backend.TrainBackend`;
the weights reach the engines through one `slime.training.weight_sync` transport. The class is
plain Python; `slime.ray.actor_group.TrainGroup` runs it as Ray actors, tests in-process (world size 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from slime.algorithms.advantages import ADVANTAGE_ESTIMATORS, whiten, whiten_stats
from slime.algorithms.losses import (
    LossInputs, aggregation_weights, kl_penalty, masked_sum, sft_loss, value_loss,
)
from slime.algorithms.off_policy import off_policy_tis, policy_loss_for, token_masks
from slime.algorithms.opd import distill_advantages, reverse_kl, served_teacher_log_probs
from slime.observability.profiling import profile_rollout
from slime.training.backend import MicroBatch, TrainBackend
from slime.training.micro_batches import token_budget_micro_batches
from slime.training.offload import Offloader, backend_tensors, resident, rss_bytes
from slime.training.throughput import StepMeter, parameter_count
from slime.training.weight_sync import check_engine_weights, make_transport
from slime.training.weight_sync.served import served_weights
from slime.types import RolloutBatch
from slime.utils.errors import SlimeConfigError
from slime.utils.hooks import load_function
from slime.utils.net import free_port, node_address
from slime.training.megatron.convert import require_megatron
from slime.utils.threads import cpu_threads

METRIC_KEYS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")
CRITIC_METRIC_KEYS = ("value_loss", "value_clipfrac", "values", "returns")


def _fsdp_backend(*args, **kwargs) -> TrainBackend:
    from slime.training.fsdp.backend import FSDPBackend  # here: the driver imports this module (TrainGroup)

    return FSDPBackend(*args, **kwargs)


def _megatron_backend(*args, **kwargs) -> TrainBackend:
    require_megatron()  # a one-line error naming the install command when megatron-core is missing
    from slime.training.megatron.backend import MegatronBackend  # optional heavy dependency: only when asked for

    return MegatronBackend(*args, **kwargs)


# --train-backend -> Backend(args, rank, world_size, master_addr, master_port, with_ref=, value_head=)
# The driver imports this module for the TrainGroup's Ray actor class, so the backends and the reference
# model's functions (slime.training.freeze), which import torch.distributed's checkpoint and tensor
# packages and transformers, are imported where they are used, in the train ranks.
BACKENDS: dict[str, Callable[..., TrainBackend]] = {"fsdp": _fsdp_backend, "megatron": _megatron_backend}

# token_loss(step, sample indices, out, entropy, loss mask) -> (per-token loss, {metric: per-token values})
TokenLoss = Callable[[int, list[int], Tensor, "Tensor | None", Tensor], tuple[Tensor, dict[str, Tensor]]]


@dataclass
class _Steps:
    """What `_run_steps` measured: per step, every metric's loss-token mean over the step (all
    ranks); the gradient norms; the loss tokens of all steps (all ranks)."""

    metrics: list[dict[str, float]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens: float = 0.0

    def mean(self) -> dict[str, float]:
        """Each metric averaged over the steps (a Python sum in step order)."""
        return {k: sum(m[k] for m in self.metrics) / len(self.metrics) for k in self.metrics[0]}

    @property
    def grad_norm(self) -> float:
        return float(sum(self.grad_norms) / len(self.grad_norms))


@dataclass
class _PolicyRollout:
    """One rollout's per-sample inputs of the policy loss (Tensor[L_i] each, on the CPU)."""

    lengths: list[int]
    advantages: list[Tensor]
    source: str  # where the old log-probs come from: "rollout" | "forward" | "pass" (see `_policy_rollout`)
    old_lps: list[Tensor | None]
    ref_lps: list[Tensor] | None
    rollout_lps: list[Tensor] | None
    pre_lps: list[Tensor | None]  # the trainer's log-probs before any update (filled by the first step)


class TrainActor:
    def __init__(self, args, rank: int = 0, world_size: int | None = None, role: str = "actor",
                 master_addr: str = "127.0.0.1", master_port: int | None = None):
        if role not in ("actor", "critic"):
            raise SlimeConfigError(f"train role {role!r} is not supported (use 'actor' or 'critic')")
        self.args = args
        self.rank = rank
        self.world_size = args.dp_size if world_size is None else world_size
        self.role = role
        self.master_addr = master_addr
        self.master_port = master_port
        self.backend: TrainBackend | None = None
        self._transport = None  # weight_sync.WeightTransport, made by init()
        self._offloader: Offloader | None = None  # made by the first offload()
        self._returns: list[Tensor] | None = None
        self._opd_kl: list[Tensor] | None = None  # --use-opd: this rollout's per-token reverse KL to the teacher
        self._old_values: tuple[int, list[Tensor]] | None = None
        self._ref_moved = False  # --ref-update-interval: the reference followed the policy (checkpoints keep it)
        threads = cpu_threads(args, "train", self.world_size)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)

    # ------------------------------------------------------------ lifecycle

    def address(self) -> str:
        """The address of this rank's node."""
        return node_address()

    def rendezvous(self) -> tuple[str, int]:
        """(rank 0) Where the train group meets: this node's address and a port free on it."""
        address = node_address()
        return address, free_port(address)

    def init(self, master_addr: str | None = None, master_port: int | None = None) -> None:
        """Build the backend (the train group meets at master_addr:master_port, from rank 0's
        `rendezvous`; default the ones given at construction)."""
        if master_addr is not None:
            self.master_addr, self.master_port = master_addr, master_port
        args = self.args
        torch.manual_seed(args.seed)
        critic = self.role == "critic"
        self.use_kl_loss = bool(args.use_kl_loss and args.kl_loss_coef > 0) and not critic
        self.use_ref = (self.use_kl_loss or args.kl_coef > 0) and not critic
        self.use_opd = bool(getattr(args, "opd_in_trainer", False) or getattr(args, "opd_served", False)) and not critic
        # every policy loss is called as loss(inputs: LossInputs); a user's takes args first
        self.policy_loss = partial(load_function(args.custom_loss_function_path, "--custom-loss-function-path"),
                                   args) if args.custom_loss_function_path else policy_loss_for(args)
        self.custom_advantage_fn = load_function(args.custom_advantage_function_path,
                                                 "--custom-advantage-function-path") \
            if args.custom_advantage_function_path else None
        tis_fn = load_function(args.custom_tis_function_path, "--custom-tis-function-path") \
            if args.custom_tis_function_path else off_policy_tis
        self.tis_fn = tis_fn if args.use_tis else None
        self._returns = None
        self._recorded_routing = None  # --use-routing-replay: this rollout's old-policy experts per sample
        self.backend = BACKENDS[args.train_backend](args, self.rank, self.world_size, self.master_addr,
                                                    self.master_port, with_ref=self.use_ref, value_head=critic,
                                                    with_teacher=self.use_opd and args.opd_in_trainer)
        # --lora-sync adapter: the engines get only the LoRA adapter (the reference model is the base)
        self.push_adapter = args.lora_sync == "adapter" and not critic
        self._transport = make_transport(args, self.rank,
                                         self.backend.adapter_config() if self.push_adapter else None)

    def ready(self) -> bool:
        return self.backend is not None

    def shutdown(self) -> None:
        for part in (self._transport, self._offloader):
            if part is not None:
                part.close()
        self._transport = self._offloader = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    # ------------------------------------------------------------ batches

    def _micro_batches(self, batch: RolloutBatch, indices: list[int]) -> list[list[int]]:
        """Split `indices` into micro-batches: `--micro-batch-size` samples each in order, or with
        `--use-dynamic-batch-size` groups of at most `--max-tokens-per-gpu` tokens (prompt +
        response; a longer sample goes alone). Every rank gets the same number of micro-batches
        (the FSDP forwards are collective): the largest any rank needs. Collective when dynamic."""
        args = self.args
        if not args.use_dynamic_batch_size:
            m = args.micro_batch_size
            return [indices[i : i + m] for i in range(0, len(indices), m)]
        lengths = [len(batch.tokens[i]) for i in indices]
        groups = token_budget_micro_batches(lengths, args.max_tokens_per_gpu)
        if self.world_size > 1:
            counts = torch.zeros(self.world_size)
            counts[self.rank] = len(groups)
            want = int(self.backend.all_reduce_sum(counts).max())
            if want > len(groups):
                groups = token_budget_micro_batches(lengths, args.max_tokens_per_gpu, want)
        return [[indices[j] for j in g] for g in groups]

    def _mb(self, batch: RolloutBatch, idx: list[int]) -> MicroBatch:
        routed = batch.routed_experts if self.args.use_rollout_routing_replay else self._recorded_routing
        return MicroBatch([batch.tokens[i] for i in idx], [batch.response_lengths[i] for i in idx],
                          [routed[i] for i in idx] if routed is not None else None,
                          [batch.images[i] for i in idx] if batch.images is not None else None)

    @staticmethod
    def _masks(batch: RolloutBatch) -> list[Tensor]:
        return [torch.as_tensor(m, dtype=torch.float32) for m in batch.loss_masks]

    def _no_grad_log_probs(self, batch: RolloutBatch, ref: bool, teacher: bool = False,
                           record_routing: bool = False) -> list[Tensor]:
        out: list[Tensor] = [None] * len(batch)  # type: ignore[list-item]
        recorded: list[Tensor | None] = [None] * len(batch)
        for idx in self._micro_batches(batch, list(range(len(batch)))):
            mb = self._mb(batch, idx)
            lp, _ = self.backend.forward_logprobs(mb, grad=False, ref=ref, teacher=teacher)
            for i, part in zip(idx, lp.detach().cpu().split([batch.response_lengths[i] for i in idx])):
                out[i] = part
            if record_routing:  # R2: the old policy's experts, replayed by the training forwards
                be = self.backend
                for i, r in zip(idx, be.routing.recorded_per_sample(be.last_routing, *be.routing_layout(mb))):
                    recorded[i] = r
        if record_routing:
            self._recorded_routing = recorded
        return out

    def _check(self, batch: RolloutBatch) -> None:
        args = self.args
        per_rank = args.global_batch_size // self.world_size
        expected = per_rank * args.num_steps_per_rollout
        if len(batch) != expected:
            raise ValueError(
                f"rank {self.rank} got {len(batch)} samples, expected {expected} "
                f"(num_steps_per_rollout {args.num_steps_per_rollout} x global_batch_size "
                f"{args.global_batch_size} / dp_size {self.world_size})"
            )
        for i in range(len(batch)):
            r = batch.response_lengths[i]
            if len(batch.loss_masks[i]) != r:
                raise ValueError(f"sample {i}: loss mask has {len(batch.loss_masks[i])} entries, response {r} tokens")

    # ------------------------------------------------------------ the step loop (policy, SFT, critic)

    def _step_weights(self, masks: list[Tensor], step_idx: list[int]) -> tuple[list[Tensor], float]:
        """Loss aggregation weights (`--loss-agg-mode`) of one step's local samples, and the step's
        global number of loss tokens."""
        args = self.args
        local_tokens = sum(float(masks[i].sum()) for i in step_idx)
        global_tokens = float(self.backend.all_reduce_sum(torch.tensor([local_tokens]))[0])
        weights = aggregation_weights([masks[i] for i in step_idx], args.loss_agg_mode, global_tokens,
                                      len(step_idx) * self.world_size, args.rollout_max_response_len)
        return weights, global_tokens

    def _run_steps(self, batch: RolloutBatch, masks: list[Tensor], token_loss: TokenLoss, keys: tuple[str, ...],
                   entropy_grad: bool = False) -> _Steps:
        """The optimizer steps of one rollout. `token_loss(s, idx, out, ent, mask)` gives micro-batch
        `idx` (sample indices) of step s its per-token loss and the per-token values to log, from
        the backend's output (log-probs, or values for the critic), entropy and loss mask (Tensor[N]
        each, on the device). Logged values are summed over loss-mask tokens (float64), all-reduced
        and divided by the step's global loss tokens; `keys` come first, any others (e.g. TIS's)
        after them sorted by name. Collective."""
        per_step = len(batch) // self.args.num_steps_per_rollout
        steps = _Steps()
        for s in range(self.args.num_steps_per_rollout):
            self._step(batch, masks, list(range(s * per_step, (s + 1) * per_step)), partial(token_loss, s), keys,
                       entropy_grad, steps)
        return steps

    def _step(self, batch: RolloutBatch, masks: list[Tensor], step_idx: list[int], token_loss, keys: tuple[str, ...],
              entropy_grad: bool, steps: _Steps) -> None:
        """One optimizer step over the samples `step_idx` (see `_run_steps`); adds to `steps`."""
        be = self.backend
        mbs = self._micro_batches(batch, step_idx)
        weights, global_tokens = self._step_weights(masks, step_idx)
        weight_of = dict(zip(step_idx, weights))
        sums: dict[str, Tensor] = {k: torch.zeros((), dtype=torch.float64) for k in keys}

        def loss_fn(k: int, out: Tensor, ent: Tensor | None) -> Tensor:
            idx = mbs[k]
            mask = torch.cat([masks[i] for i in idx]).to(be.device)
            tok_loss, values = token_loss(idx, out, ent, mask)
            with torch.no_grad():
                for key, v in values.items():
                    sums[key] = sums.get(key, torch.zeros((), dtype=torch.float64)) + \
                        masked_sum(v.detach().double(), mask).cpu()
            w = torch.cat([weight_of[i] for i in idx]).to(be.device)
            return (tok_loss * w).sum() * self.world_size

        steps.grad_norms.append(be.train_step([self._mb(batch, idx) for idx in mbs], loss_fn,
                                              entropy_grad=entropy_grad))
        names = list(keys) + sorted(set(sums) - set(keys))  # the same on every rank
        totals = be.all_reduce_sum(torch.stack([sums[n] for n in names])) / max(global_tokens, 1.0)
        steps.metrics.append(dict(zip(names, totals.tolist())))
        steps.tokens += global_tokens

    # ------------------------------------------------------------ policy (role "actor")

    @resident
    def train(self, rollout_id: int, batch: RolloutBatch, values: list[Tensor] | None = None) -> dict[str, float]:
        """One rollout of policy training; `values` (PPO) are the critic's per-token values of `batch`."""
        with profile_rollout(self.args, rollout_id, self.rank, self.role):  # --profile-rollouts A-B
            return self._train(rollout_id, batch, values)

    def _train(self, rollout_id: int, batch: RolloutBatch, values: list[Tensor] | None) -> dict[str, float]:
        args, be = self.args, self.backend
        if be is None:
            raise RuntimeError("TrainActor.init() was not called")
        if self.role == "critic":
            raise RuntimeError("TrainActor.train is the actor's; the critic trains with train_critic")
        self._check(batch)
        if args.loss_type == "sft_loss":
            return self._train_sft(batch)
        if args.use_critic and values is None:
            raise ValueError(f"--advantage-estimator {args.advantage_estimator} needs critic values")
        meter = StepMeter(be.device)
        masks = self._masks(batch)
        ro = self._policy_rollout(batch, masks, values)
        steps = self._run_steps(batch, masks, partial(self._policy_token_loss, ro), METRIC_KEYS,
                                entropy_grad=bool(args.entropy_coef))
        from slime.training.freeze import copy_policy_into_reference, ref_update_due  # see BACKENDS

        if self.use_ref and ref_update_due(rollout_id, args.ref_update_interval):  # the reference follows the policy
            copy_policy_into_reference(be.model, be.ref_model)
            self._ref_moved = True
        metrics = {f"train/{k}": v for k, v in steps.mean().items()}
        metrics.update({f"train/{k}": v for k, v in be.routing.take_metrics(be.all_reduce_sum).items()})
        metrics["train/grad_norm"] = steps.grad_norm
        metrics["train/lr"] = be.lr
        diff = self._logprob_mismatch(batch, masks, ro.pre_lps)
        if diff[1] > 0:
            metrics["train/train_rollout_logprob_abs_diff"] = float(diff[0] / diff[1])
        adv_stats = be.all_reduce_sum(whiten_stats(ro.advantages, masks))
        metrics["train/advantage_mean"] = float(adv_stats[0] / max(float(adv_stats[2]), 1.0))
        if self._opd_kl is not None:  # the per-token reverse KL to the teacher, over every rank's loss tokens
            kl_stats = be.all_reduce_sum(whiten_stats(self._opd_kl, masks))
            metrics["train/opd_reverse_kl"] = float(kl_stats[0] / max(float(kl_stats[2]), 1.0))
        extra_forwards = int(ro.ref_lps is not None) + int(ro.source == "pass")
        metrics.update(meter.metrics(parameter_count(be.model), sum(map(len, batch.tokens)), extra_forwards))
        return metrics

    def _policy_rollout(self, batch: RolloutBatch, masks: list[Tensor], values) -> _PolicyRollout:
        """Steps 1-3 of the module docstring: reference and old log-probs, advantages (and the critic's returns)."""
        args, n = self.args, len(batch)
        rollout_lps = None
        if args.use_tis or args.use_rollout_logprobs:
            rollout_lps = self._rollout_log_probs(batch, "--use-tis" if args.use_tis else "--use-rollout-logprobs")
        ref_lps = self._no_grad_log_probs(batch, ref=True) if self.use_ref else None
        # old log-probs (the PPO ratio's denominator), from one of three sources:
        #   "rollout": the engine's (--use-rollout-logprobs), no extra pass;
        #   "forward": one step per rollout and nothing needing them before the update: the detached
        #              log-probs of the training forward itself (ratio exactly 1);
        #   "pass":    a no-grad pass before any update.
        # `pre_lps` are the trainer's log-probs before any update (for TIS and the mismatch metric).
        if args.use_rollout_logprobs:
            source = "rollout"
        elif args.num_steps_per_rollout == 1 and args.kl_coef == 0 and not self.use_opd and not args.use_routing_replay:
            source = "forward"
        else:
            source = "pass"  # (--use-routing-replay: this pass records the routing the updates replay)
        self._recorded_routing = None
        pre_lps: list[Tensor | None] = self._no_grad_log_probs(
            batch, ref=False, record_routing=args.use_routing_replay) if source == "pass" else [None] * n
        old_lps: list[Tensor | None] = rollout_lps if source == "rollout" else pre_lps
        kl = [kl_penalty(old_lps[i], ref_lps[i], args.kl_loss_type) for i in range(n)] if args.kl_coef > 0 else None
        # --use-opd: reverse KL (student - teacher) in the advantages; the teacher: the batch (served) or a forward
        teacher = (served_teacher_log_probs(batch.teacher_log_probs, old_lps, masks) if args.opd_served else
                   self._no_grad_log_probs(batch, ref=False, teacher=True)) if self.use_opd else None
        self._opd_kl = reverse_kl(old_lps, teacher) if self.use_opd else None
        advantages, self._returns = self._advantages(batch, masks, kl, values)
        return _PolicyRollout(list(batch.response_lengths), advantages, source, old_lps, ref_lps, rollout_lps, pre_lps)

    def _policy_token_loss(self, ro: _PolicyRollout, s: int, idx: list[int], lp: Tensor, ent: Tensor,
                           mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Policy loss (+ TIS, KL loss, entropy bonus) of one micro-batch, and its logged values."""
        args, dev = self.args, self.backend.device
        split = [ro.lengths[i] for i in idx]
        current = lp.detach()
        if s == 0 and ro.source != "pass":  # the first step's forward runs before any update
            for i, part in zip(idx, current.cpu().split(split)):
                ro.pre_lps[i] = part
        old = current if ro.source == "forward" else torch.cat([ro.old_lps[i] for i in idx]).to(dev)
        adv = torch.cat([ro.advantages[i] for i in idx]).to(dev)
        pg, clipfrac = self.policy_loss(LossInputs(
            log_probs=lp, old_log_probs=old, advantages=adv,
            loss_mask=mask, response_lengths=split, eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high,
            eps_clip_c=args.eps_clip_c))
        extra: dict[str, Tensor] = {}
        if self.tis_fn is not None:
            # the trainer's log-probs under the policy that generated the rollout vs the engine's
            train_side = current if ro.source == "rollout" else old
            rl = torch.cat([ro.rollout_lps[i] for i in idx]).to(dev)
            pg, pg_mask, extra = self.tis_fn(args, pg_loss=pg, train_log_probs=train_side, rollout_log_probs=rl,
                                             loss_mask=mask, response_lengths=split)
            pg = pg * pg_mask.to(pg.dtype)
        pi_old = torch.cat([ro.rollout_lps[i] for i in idx]).to(dev) if ro.rollout_lps is not None else old
        pg, masked = token_masks(args, pg_loss=pg, log_probs=current, old_log_probs=pi_old, advantages=adv,
                                 entropy=ent, loss_mask=mask, response_lengths=split)
        extra.update(masked)
        tok_loss = pg
        kl_tok = torch.zeros_like(pg)
        if self.use_kl_loss:
            ref = torch.cat([ro.ref_lps[i] for i in idx]).to(dev)
            ratio = torch.exp(lp - old) if args.use_unbiased_kl else None
            kl_tok = kl_penalty(lp, ref, args.kl_loss_type, importance_ratio=ratio)
            tok_loss = tok_loss + args.kl_loss_coef * kl_tok
        if args.entropy_coef:
            tok_loss = tok_loss - args.entropy_coef * ent
        logged = dict(zip(METRIC_KEYS, (tok_loss, pg, kl_tok, ent, clipfrac, old - current)))
        logged.update(extra)
        return tok_loss, logged

    def _advantages(self, batch: RolloutBatch, masks: list[Tensor], kl, values) -> tuple[list[Tensor], list | None]:
        """Per-token advantages (and, with critic values, the critic's returns) of this rank's samples."""
        args = self.args
        rewards = torch.as_tensor(batch.rewards, dtype=torch.float32)
        inputs = dict(loss_masks=masks, kl=kl, values=values, kl_coef=args.kl_coef, gamma=args.gamma,
                      lambd=args.lambd)
        if self.custom_advantage_fn is not None:
            advantages = self.custom_advantage_fn(args, rewards, list(batch.response_lengths), **inputs,
                                                  group_indices=list(batch.group_indices),
                                                  raw_rewards=list(batch.raw_rewards))
        else:
            advantages = ADVANTAGE_ESTIMATORS[args.advantage_estimator](rewards, batch.response_lengths, **inputs)
        advantages = [torch.as_tensor(a, dtype=torch.float32) for a in advantages]
        bad = [i for i, a in enumerate(advantages) if a.shape != (batch.response_lengths[i],)]
        if len(advantages) != len(batch) or bad:
            raise ValueError(f"advantage function returned {len(advantages)} tensors for {len(batch)} samples"
                             + (f"; sample {bad[0]} has shape {tuple(advantages[bad[0]].shape)}, expected "
                                f"({batch.response_lengths[bad[0]]},)" if bad else ""))
        returns = [a + torch.as_tensor(v, dtype=torch.float32) for a, v in zip(advantages, values)] \
            if values is not None else None
        if self.role == "actor" and self._opd_kl is not None:  # the critic's returns stay the task's
            advantages = distill_advantages(advantages, self._opd_kl, args.opd_kl_coef)
        if args.normalize_advantages:
            advantages = whiten(advantages, self.backend.all_reduce_sum(whiten_stats(advantages, masks)))
        return advantages, returns

    def _rollout_log_probs(self, batch: RolloutBatch, why: str) -> list[Tensor]:
        """The engine's log-probs of every sample (Tensor[L_i] each); an error when one is missing."""
        out = []
        for i, r in enumerate(batch.response_lengths):
            lp = self._engine_log_probs(batch, i)
            if lp is None or len(lp) != r:
                raise ValueError(f"{why} needs the engine's log-probs of every response token; sample {i} has "
                                 f"{'none' if lp is None else len(lp)} for {r} tokens")
            out.append(torch.as_tensor(lp, dtype=torch.float32))
        return out

    @staticmethod
    def _engine_log_probs(batch: RolloutBatch, i: int) -> list[float] | None:
        lps = batch.rollout_log_probs
        return lps[i] if lps is not None and i < len(lps) else None

    def _logprob_mismatch(self, batch: RolloutBatch, masks: list[Tensor], pre_lps: list[Tensor | None]) -> Tensor:
        """[sum over loss-mask tokens of |train log-prob before the update - rollout log-prob|, those
        tokens] over all ranks (samples without the engine's log-probs left out). Collective."""
        diff = torch.zeros(2, dtype=torch.float64)
        for i, r in enumerate(batch.response_lengths):
            rl = self._engine_log_probs(batch, i)
            if rl is not None and len(rl) == r and r > 0 and pre_lps[i] is not None:
                diff[0] += float(masked_sum((pre_lps[i].float() - torch.as_tensor(rl, dtype=torch.float32)).abs(),
                                            masks[i]))
                diff[1] += float(masks[i].sum())
        return self.backend.all_reduce_sum(diff)

    def last_returns(self) -> list[Tensor] | None:
        """The critic's targets from the last `train` (PPO): advantages + values, before whitening."""
        return self._returns

    # ------------------------------------------------------------ SFT (--loss-type sft_loss)

    def _train_sft(self, batch: RolloutBatch) -> dict[str, float]:
        """Negative log-likelihood of the loss-mask tokens, aggregated with `--loss-agg-mode` over the
        same steps and micro-batches as the RL loss."""
        steps = self._run_steps(batch, self._masks(batch), self._sft_token_loss, ("loss",))
        loss = steps.mean()["loss"]
        return {"train/loss": loss, "train/sft_loss": loss, "train/grad_norm": steps.grad_norm,
                "train/lr": self.backend.lr, "train/loss_tokens": steps.tokens}

    @staticmethod
    def _sft_token_loss(s: int, idx: list[int], lp: Tensor, ent, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        tok_loss = sft_loss(lp)
        return tok_loss, {"loss": tok_loss}

    # ------------------------------------------------------------ critic (role "critic")

    def _no_grad_values(self, batch: RolloutBatch) -> list[Tensor]:
        out: list[Tensor] = [None] * len(batch)  # type: ignore[list-item]
        for idx in self._micro_batches(batch, list(range(len(batch)))):
            v = self.backend.forward_values(self._mb(batch, idx), grad=False)
            for i, part in zip(idx, v.detach().cpu().split([batch.response_lengths[i] for i in idx])):
                out[i] = part
        return out

    @resident
    def compute_values(self, rollout_id: int, batch: RolloutBatch) -> list[Tensor]:
        """The critic's per-token values of `batch` before any update (kept as the value-clip anchor)."""
        if self.role != "critic":
            raise RuntimeError("compute_values is a critic method")
        self._check(batch)
        self._old_values = (rollout_id, self._no_grad_values(batch))
        return self._old_values[1]

    @resident
    def train_critic(self, rollout_id: int, batch: RolloutBatch, returns: list[Tensor]) -> dict[str, float]:
        """Regress values on `returns` (clipped value loss, `--value-clip`), same steps as the actor."""
        if self.role != "critic":
            raise RuntimeError("train_critic is a critic method")
        self._check(batch)
        masks = self._masks(batch)
        cached = self._old_values
        old_values = cached[1] if cached is not None and cached[0] == rollout_id else self._no_grad_values(batch)
        if returns is None or len(returns) != len(batch):
            raise ValueError(f"critic got {0 if returns is None else len(returns)} returns for {len(batch)} samples")
        steps = self._run_steps(batch, masks, partial(self._value_token_loss, old_values, returns), CRITIC_METRIC_KEYS)
        # torch's mean over the steps (its summation order differs from Python's sum from 5 steps
        # on): the critic's metrics stay bitwise those of earlier runs
        mean = torch.tensor([[m[k] for k in CRITIC_METRIC_KEYS] for m in steps.metrics], dtype=torch.float64).mean(0)
        metrics = {f"critic/{k}": float(mean[j]) for j, k in enumerate(CRITIC_METRIC_KEYS)}
        metrics["critic/grad_norm"] = steps.grad_norm
        metrics["critic/lr"] = self.backend.lr
        self._old_values = None
        return metrics

    def _value_token_loss(self, old_values: list[Tensor], returns: list[Tensor], s: int, idx: list[int],
                          values: Tensor, ent, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        dev = self.backend.device
        old = torch.cat([old_values[i] for i in idx]).to(dev)
        ret = torch.cat([torch.as_tensor(returns[i], dtype=torch.float32) for i in idx]).to(dev)
        loss, clipfrac = value_loss(values, old, ret, self.args.value_clip)
        return loss, dict(zip(CRITIC_METRIC_KEYS, (loss, clipfrac, values, ret)))

    # ------------------------------------------------------------ weights and checkpoints

    @resident
    def update_weights(self, engine_urls: list[str], weight_version: int) -> dict:
        """Push the weights to `engine_urls` through this run's transport (`--update-weights-mode`,
        slime/training/weight_sync/). Collective."""
        self._transport.connect(engine_urls)
        weights = self.backend.adapter_weights() if self.push_adapter else self.backend.named_weights()
        return self._transport.push(self._engine_dtype(weights, names=not self.push_adapter), weight_version)

    @resident
    def check_weights(self, engine_urls: list[str]) -> int:
        """Collective: rank 0 checks that every engine serves exactly this rank's full weights (in
        the engines' dtype; with --lora-sync adapter the base they hold besides the adapter)."""
        weights = self.backend.base_weights() if self.push_adapter else self.backend.named_weights()
        return check_engine_weights(self._engine_dtype(weights), engine_urls, check=self.rank == 0)

    def _engine_dtype(self, named_weights, names: bool = True):
        """The weights in the engines' dtype and (`names`) under their names (slime.training.weight_sync.served)."""
        return served_weights(self.args, self.backend.hf_config if names else None, named_weights)

    # ------------------------------------------------------------ colocated memory handoff

    def offload(self) -> dict:
        """--colocate: free this rank's parameters, optimizer state and reference model while the
        engines generate (slime/training/offload.py). Returns {"bytes", "seconds", "rss"}."""
        if self._offloader is None:
            self._offloader = Offloader(self.args.offload_dir)
        stats = self._offloader.offload(backend_tensors(self.backend), self.backend.device)
        return dict(stats, rss=rss_bytes())

    def onload(self) -> dict:
        """Undo `offload` (bitwise). Returns {"bytes", "seconds", "rss"}."""
        off = self._offloader
        stats = off.onload() if off is not None else {"bytes": 0, "seconds": 0.0}
        return dict(stats, rss=rss_bytes())

    @resident
    def save(self, path: str) -> None:
        """Model and optimizer (the backend's format), a reference that followed the policy, this rank's RNG states."""
        from slime.training.freeze import save_reference  # see BACKENDS
        from slime.utils.checkpoint_data import rng_states  # it imports torch.distributed.checkpoint

        self.backend.save(path)
        if self._ref_moved:
            save_reference(self.backend, path)
        torch.save(rng_states(), os.path.join(path, f"rng_{self.role}_rank{self.rank}.pt"))

    @resident
    def load(self, path: str) -> None:
        from slime.training.freeze import load_reference  # see BACKENDS
        from slime.utils.checkpoint_data import load_tensors_file, set_rng_states  # see save

        self.backend.load(path)
        self._ref_moved = load_reference(self.backend, path) or self._ref_moved
        rng_path = os.path.join(path, f"rng_{self.role}_rank{self.rank}.pt")
        if os.path.isfile(rng_path):  # absent when resuming with more ranks than were saved
            set_rng_states(load_tensors_file(rng_path))

    @resident(stay=True)  # in-process callers may get views of the weights
    def full_state(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """Full model (and optimizer) state dicts on rank 0 (empty elsewhere). Collective; for tests/tools."""
        return self.backend.full_state(optimizer)

