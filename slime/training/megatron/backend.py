"""megatron-core training backend (`--train-backend megatron`): `slime.training.backend.TrainBackend`,
like FSDPBackend. This module imports megatron-core at the top: the trainer imports it only for
`--train-backend megatron`, after checking that megatron-core is installed.

Model: a megatron-core GPTModel (local layer spec) built from the HF config and filled from
the HF checkpoint (`model.py`, `weights.py`), fp32 master weights, kept in eval mode
(no dropout), so a no-grad pass and a training pass give identical log-probs. With --bf16 the
parameters compute in bf16 and their fp32 main copies are what the optimizer, the gradient
reduction and checkpoints see (precision.py); the reference and teacher models are bf16 only.

Parallelism. Every train rank (TrainGroup actor) keeps its own samples, exactly as with
FSDP, so the actor's data split, loss scaling and metrics do not change. Ranks are laid out
by megatron's `parallel_state` (order tp-cp-ep-dp-pp); with `--tensor-model-parallel-size`
T > 1 the T ranks of a TP group run *one* forward over the concatenation of their
micro-batches (gathered as token lists), each rank computes its own samples' loss with the
actor's `loss_fn` on the (detached) slice of log-probs it owns, the d loss / d log-prob
slices are summed over the TP group, and every TP rank back-propagates the same total
upstream gradient through the TP-sharded graph - which is what megatron's collectives in
the tensor-parallel layers assume. Gradients are then summed over the data-parallel group
and divided by the number of train ranks (the actor multiplies each rank's loss by it, as
for FSDP's averaging). Pipeline parallelism runs megatron-core's schedules (pipeline.py);
context parallelism is rejected (see `_check_parallel`).

Optimizer: torch AdamW over this rank's (TP-sharded) parameters, or with
--use-distributed-optimizer slime's ZeRO-1 AdamW (optimizer.py: each data-parallel rank keeps
and updates its share of the state); gradient clipping uses the global norm (TP-sharded
parameters summed over the model-parallel group, replicated ones counted once). megatron's
DistributedDataParallel / DistributedOptimizer are not used (shims.py says why).

Checkpoints: `path/hf` (HF safetensors, rank 0) and `path/train_state/`: model and AdamW state
in megatron's distributed checkpoint format (dist_checkpoint.py), which reshards: a run saved at
one layout resumes at another (TP, PP, DP size, distributed optimizer or not).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM

from slime.training.backend import LossFn, MicroBatch, StepTail
from slime.training import lr_schedule
from slime.training.lr_schedule import LRSchedule
from slime.training.megatron import critic, grads, moe, shims, vision
from slime.training.megatron.dist_checkpoint import load_train_state, save_train_state
from slime.training.megatron.head import OutputHead, output_weight
from slime.training.megatron.model import PipelineLayout, build_model
from slime.training.megatron.optimizer import ShardedAdamW
from slime.training.megatron.precision import MainParams
from slime.training.megatron.pipeline import (
    FILLER,
    Pipeline,
    batch_inputs,
    gather_group_micro_batches,
    gather_stages,
    response_scores,
)
from slime.training.megatron.weights import full_mcore_state, full_optimizer_state, load_hf_into, to_hf
from slime.utils.dist import init_process_group
from slime.utils.errors import SlimeConfigError
from slime.utils.hf_export import hf_checkpoint_names, write_hf_dir
from slime.training.freeze import freeze_parameters
from slime.training.moe import TrainRouting
from slime.utils.net import node_address
from slime.utils.vision import VisionProcessor, is_vision_config, megatron_refusal


logger = logging.getLogger(__name__)

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


def _check_parallel(args, world_size: int) -> tuple[int, int, int]:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp):
        raise SlimeConfigError(f"tensor x pipeline x context parallel sizes ({tp} x {pp} x {cp}) must divide the "
                               f"{world_size} train ranks")
    if cp > 1:
        raise SlimeConfigError("--context-parallel-size > 1 needs Transformer Engine's attention on GPUs "
                               "(megatron-core's local attention has no context-parallel path)")
    return tp, pp, cp


class MegatronBackend(StepTail):
    """One train rank of a megatron-core GPTModel (TP-sharded) plus its optimizer."""

    def __init__(self, args, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, with_ref: bool = False, value_head: bool = False,
                 with_teacher: bool = False):
        self.args, self.rank, self.world_size = args, rank, world_size
        self.value_head = value_head  # the PPO critic: a value head on the policy's backbone (critic.py)
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.tp, self.pp, _ = _check_parallel(args, world_size)
        if args.recompute_granularity and self.device.type != "cuda":
            raise SlimeConfigError(f"--recompute-granularity {args.recompute_granularity} with --train-backend megatron "
                                   "needs CUDA (megatron-core's recompute saves and restores the CUDA RNG states); on "
                                   "CPU use --train-backend fsdp")
        if args.optimizer_cpu_offload:
            if self.device.type == "cuda":
                raise SlimeConfigError("--optimizer-cpu-offload with --train-backend megatron on a GPU is not built "
                                       "(megatron's offload lives in its DistributedOptimizer, which slime does not "
                                       "use); use --train-backend fsdp")
            if rank == 0:
                logger.info("--optimizer-cpu-offload: this run trains on the CPU, where the optimizer state already "
                            "is; nothing changes")
        sft = args.loss_type == "sft_loss"
        self.temperature = args.rollout_temperature if args.rollout_temperature > 0 and not sft else 1.0

        self._owns_process_group = False
        if not dist.is_initialized():
            if master_port is None:
                raise ValueError("MegatronBackend needs master_port to create the process group")
            # the store and this rank's gloo sockets bind its node's address only (slime.utils.dist)
            init_process_group(self.device.type, rank, world_size, master_addr, master_port,
                               PROCESS_GROUP_TIMEOUT, bind_address=node_address())
            self._owns_process_group = True
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"process group has {dist.get_world_size()} ranks, expected {world_size}")
        self.hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
        # a vision-language model: its language model as a GPTModel with multimodal rope (hf_config: that
        # Qwen2 LM) and the checkpoint's HF vision tower on each chunk (vision.py)
        self.vl_config, self.mrope_section = None, None
        if is_vision_config(self.hf_config):
            why = megatron_refusal(self.pp, value_head, with_teacher)
            if why:
                raise SlimeConfigError(why)
            self.vl_config = self.hf_config
            self.hf_config, self.mrope_section = vision.lm_config(self.vl_config)
        self.layout = PipelineLayout.from_args(args, self.hf_config.num_hidden_layers)
        self.layout.check(self.hf_config.num_hidden_layers)
        # mixture of experts: megatron's MoE layers, --expert-model-parallel-size (moe.py)
        self.moe = moe.is_moe(self.hf_config)
        self.ep = args.expert_model_parallel_size if self.moe else 1
        # --expert-tensor-parallel-size: megatron's default is the TP size (each expert split over the TP
        # group like the dense MLP); 1 keeps every expert whole on each TP rank
        self.etp = (args.expert_tensor_parallel_size or self.tp) if self.moe else 1
        if moe.is_moe(self.hf_config):
            moe.check_moe_args(args, self.hf_config, self.tp, self.pp, self.ep, self.etp, world_size)
        self._owns_mp = not ps.model_parallel_is_initialized()
        if self._owns_mp:
            ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                                         virtual_pipeline_model_parallel_size=self.layout.vp
                                         if self.layout.vp > 1 else None, expert_model_parallel_size=self.ep,
                                         expert_tensor_parallel_size=self.etp)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.mp_group = ps.get_model_parallel_group()  # TP x PP: one pipeline over the group's samples
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        if self.etp > 1 and dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group()) != \
                dist.get_process_group_ranks(self.tp_group):  # weights.py splits the experts as the TP group
            raise SlimeConfigError(f"--expert-tensor-parallel-size {self.etp}: megatron's expert tensor-parallel "
                                   "group is not the tensor-parallel group")
        shims.use_cpu_rng_tracker()

        if value_head:  # the FSDP critic's weights: HF's token-classification model (its config included)
            critic.check_critic(self.hf_config)
            self.hf_config, critic_state = critic.hf_state(args.hf_checkpoint)
            hf_state = (critic_state, None)
        else:
            hf_state = self._hf_state(args.hf_checkpoint)
        self.dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.model = self._build(hf_state, recompute=True, value_head=value_head, load_dtype=torch.float32)
        # a VL model's images -> pixel inputs (slime.training.vision)
        self.images = VisionProcessor(args.hf_checkpoint, config=self.vl_config) if self.vl_config else None
        if args.freeze_params_name_list and not value_head:  # megatron-core's parameter names; these never train
            freeze_parameters(self.model, args.freeze_params_name_list)
        # --bf16: bf16 parameters compute, fp32 main copies train (precision.py)
        self.main_params = MainParams(self.chunks, self.dtype) if args.bf16 else None
        # MoE: the load-balancing loss, expert usage and routing replay of the policy's forwards
        self.routing = moe.MegatronRouting(self.model, args.moe_aux_loss_coeff, self.hf_config.num_hidden_layers) \
            if moe.is_moe(self.hf_config) \
            else TrainRouting(self.model)
        self.last_routing = None  # what the routers used in the last policy forward (slime.training.moe)
        self.ref_model = None
        if with_ref:  # --ref-load: another checkpoint of the same vocabulary (checked at parse time)
            self.ref_model = self._build(self._hf_state(args.ref_load) if args.ref_load else hf_state, recompute=False)
            self.ref_model.requires_grad_(False)
        self.teacher_model = None
        if with_teacher:  # --opd-teacher-load: the student's architecture with the teacher's weights
            self._check_teacher_shape(args.opd_teacher_load)
            self.teacher_model = self._build(self._hf_state(args.opd_teacher_load), recompute=False)
            self.teacher_model.requires_grad_(False)
        del hf_state
        self.vocab_size = self.hf_config.vocab_size
        self.seq_multiple = self.tp if args.sequence_parallel else 1  # SP splits the sequence over TP ranks
        # --log-probs-chunk-size: log-probs from the hidden states, the output layer chunk by chunk (head.py)
        self.head = OutputHead(self.vocab_size, self.temperature, args.log_probs_chunk_size) \
            if args.log_probs_chunk_size and not value_head else None
        moe_routing = self.routing if isinstance(self.routing, moe.MegatronRouting) else None
        self.pipeline = Pipeline(self.device, self.vocab_size, self.temperature, self.seq_multiple,
                                 scores=critic.response_values if value_head else None, head=self.head,
                                 before_forward=moe_routing.before_forward if moe_routing else None) \
            if self.pp > 1 else None
        self.lr_schedule = LRSchedule.from_args(args, args.critic_lr if value_head else args.lr)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._expert_param_ids = {id(p) for c in self.chunks for n, p in c.named_parameters() if moe.is_expert(n)}
        adam = dict(lr=self.lr_schedule.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                    weight_decay=args.weight_decay)
        # --use-distributed-optimizer: each data-parallel rank keeps the AdamW state of its share of the
        # parameters and updates them (optimizer.py); experts are shared over the ranks that hold them
        self.optimizer = ShardedAdamW(params, self.dp_group, dp_group_of=self._replica_group, **adam) \
            if args.use_distributed_optimizer else torch.optim.AdamW(params, **adam)
        lr_schedule.start(self.lr_schedule, self.optimizer.param_groups)

    def _replica_group(self, p: Tensor):
        """The group `p` is replicated over (its gradient is all-reduced over it): the expert-data-parallel
        group for an expert's weights under expert parallelism, the data-parallel group otherwise."""
        if self.moe and id(p) in self._expert_param_ids:
            return ps.get_expert_data_parallel_group()
        return self.dp_group

    def _check_teacher_shape(self, path: str) -> None:
        teacher = AutoConfig.from_pretrained(path)
        keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings")
        diff = [k for k in keys if getattr(teacher, k, None) != getattr(self.hf_config, k, None)]
        if diff:
            raise SlimeConfigError(f"--opd-teacher-load {path}: {diff[0]} is {getattr(teacher, diff[0], None)}, the "
                                   f"student's {getattr(self.hf_config, diff[0], None)}; the megatron backend loads "
                                   "the teacher into the student's architecture (use --train-backend fsdp for a "
                                   "teacher of another shape)")

    def _hf_state(self, path: str) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
        """(the checkpoint's causal-LM state, a VL model's vision tower state or None), fp32."""
        if self.vl_config is not None:
            return vision.hf_state(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return {k: v.detach() for k, v in hf.state_dict().items()}, None

    def _build(self, hf_state, recompute: bool, value_head: bool = False, load_dtype: torch.dtype | None = None):
        """This rank's model chunk(s) with the checkpoint's weights (a ModuleList of the chunks with
        virtual pipeline stages); `hf_state`: `_hf_state`'s pair; `recompute`: with --recompute-* (the
        trained model); `value_head`: the critic (critic.py), from a token-classification state dict;
        computing in `self.dtype`, with parameters of `load_dtype` (default `self.dtype`)."""
        args = self.args
        hf_state, tower_state = hf_state
        chunks = []
        config = critic.build_config(self.hf_config) if value_head else self.hf_config
        for vp_stage in range(self.layout.vp):
            with shims.cpu_only_cuda_shims():
                model = build_model(config, tp=self.tp, sequence_parallel=args.sequence_parallel,
                                    vocab_divisible_by=args.make_vocab_size_divisible_by,
                                    recompute=(args.recompute_granularity, args.recompute_method,
                                               args.recompute_num_layers) if recompute else (None, None, None),
                                    layout=self.layout, vp_stage=vp_stage, ep=self.ep, etp=self.etp, dtype=self.dtype,
                                    load_dtype=load_dtype, mrope_section=self.mrope_section)
            if value_head:
                critic.attach_value_head(model, self.hf_config, args.sequence_parallel, bias="score.bias" in hf_state)
                critic.load_into(model, hf_state, self.hf_config, self.tp, self.tp_rank)
            else:
                load_hf_into(model, hf_state, self.hf_config, self.tp, self.tp_rank)
            if tower_state is not None:
                vision.attach(model, self.vl_config, tower_state, args.sequence_parallel)
            chunks.append(model.to(self.device))
        return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)

    @staticmethod
    def _chunks(model) -> list:
        return list(model) if isinstance(model, torch.nn.ModuleList) else [model]

    # ------------------------------------------------------------ forward

    def _gather_tp(self, mb) -> tuple[list[list[int]], list[int], int, int]:
        """The TP group's micro-batches concatenated in TP-rank order, and this rank's sample range."""
        tokens, lengths = [list(t) for t in mb.tokens], list(mb.response_lengths)
        if self.tp == 1:
            return tokens, lengths, 0, len(tokens)
        parts: list = [None] * self.tp
        dist.all_gather_object(parts, (tokens, lengths), group=self.tp_group)
        start = sum(len(p[0]) for p in parts[: self.tp_rank])
        all_tokens = [t for p in parts for t in p[0]]
        all_lengths = [r for p in parts for r in p[1]]
        return all_tokens, all_lengths, start, start + len(tokens)

    def _forward(self, model, tokens, lengths, *, with_entropy: bool, entropy_grad: bool, images=None):
        """Per-sample log-probs (and entropy) of the response tokens (one pipeline stage): lists of Tensor[r_i];
        `images`: a VL model's image sources per sample."""
        if not tokens:
            if self.ep > 1:  # the other EP ranks' token dispatch needs this rank
                moe.idle_forward(model, self.device, backward=False, seq_len=self.seq_multiple)
            return [], []
        ids, pos, mask, prompt_lens = batch_inputs(tokens, lengths, self.device, seq_multiple=self.seq_multiple)
        inputs = vision.image_forward(model, self.images, images, ids, [len(t) for t in tokens]) \
            if self.vl_config is not None else contextlib.nullcontext(pos)
        if self.head is not None:
            with shims.cpu_only_cuda_shims(), self.head.hidden_states(model), inputs as pos:
                hidden = model(ids, pos, attention_mask=mask)  # [b, t, H]
            return self.head.scores(hidden, output_weight(model), ids, prompt_lens, lengths,
                                    with_entropy=with_entropy, entropy_grad=entropy_grad)
        with shims.cpu_only_cuda_shims(), inputs as pos:
            logits = model(ids, pos, attention_mask=mask)  # [b, t, V_padded]
        return response_scores(logits[..., : self.vocab_size], ids, prompt_lens, lengths, self.temperature,
                               with_entropy=with_entropy, entropy_grad=entropy_grad)

    def forward_logprobs(self, mb: MicroBatch, *, grad: bool = False, with_entropy: bool = False,
                         entropy_grad: bool = False, ref: bool = False,
                         teacher: bool = False) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropy) of every response token of this rank's micro-batch, Tensor[N]
        in sample order (collective over the TP group)."""
        model = self.teacher_model if teacher else self.ref_model if ref else self.model
        if model is None:
            raise RuntimeError(f"no {'teacher' if teacher else 'reference'} model was built")
        ref = ref or teacher  # frozen: never with gradient
        if grad and self.tp * self.pp > 1 and not ref:
            raise RuntimeError("with tensor or pipeline parallelism, gradients go through train_step (the group's "
                               "losses are combined there)")
        if self.pp > 1:
            return self._pipeline_logprobs(model, mb, with_entropy)
        tokens, lengths, s, e = self._gather_tp(mb)
        images = vision.group_images(mb, self.tp_group) if self.vl_config else None
        if self.tp > 1 and model is self.model and self._moe_routing() and tokens:  # MoE under TP + SP
            with torch.set_grad_enabled(grad and not ref):
                lps, ents, _ = moe.routed_tp_forward(self, mb, tokens, lengths, s, e, with_entropy=with_entropy,
                                                       entropy_grad=entropy_grad and grad)
        else:
            with torch.set_grad_enabled(grad and not ref), moe.policy_routing(self, model, mb):
                lps, ents = self._forward(model, tokens, lengths, with_entropy=with_entropy,
                                          entropy_grad=entropy_grad and grad, images=images)
        lp = torch.cat(lps[s:e]) if e > s else torch.zeros(0, device=self.device)
        ent = (torch.cat(ents[s:e]) if e > s else torch.zeros(0, device=self.device)) if with_entropy else None
        return lp, ent

    def _moe_routing(self) -> "moe.MegatronRouting | None":
        return self.routing if isinstance(self.routing, moe.MegatronRouting) and self.routing.enabled else None

    def _pipeline_logprobs(self, model, mb: MicroBatch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        tokens, lengths, s, e = gather_group_micro_batches([list(t) for t in mb.tokens], list(mb.response_lengths),
                                                           self.mp_group)
        if not tokens:
            if self.ep > 1:  # the other pipelines' expert dispatch (all-to-all on every stage) needs this one
                self.pipeline.forward(self._chunks(model), [FILLER], with_entropy=False)
            return torch.zeros(0, device=self.device), torch.zeros(0, device=self.device) if with_entropy else None
        if model is not self.model or not isinstance(self.routing, moe.MegatronRouting):
            [(lp, ent)] = self.pipeline.forward(self._chunks(model), [(tokens, lengths)], with_entropy=with_entropy)
        else:  # MoE: replay (R2/R3) and record (R2) the policy's routing, as policy_routing does without PP
            routed = [moe.group_routed(mb, self.mp_group)]
            with self.routing.routing_pass(routed, capture=True) as routing_pass:
                [(lp, ent)] = self.pipeline.forward(self.chunks, [(tokens, lengths)], with_entropy=with_entropy)
            self.last_routing = self.routing.joined_recording(
                routing_pass, 0, self.pipeline.shape(self.pipeline.padded([(tokens, lengths)])), (s, e),
                max(len(t) for t in mb.tokens) if mb.tokens else 0, self.mp_group)
        a, b = sum(lengths[:s]), sum(lengths[:e])
        return lp[a:b], ent[a:b] if with_entropy else None

    routing_layout = staticmethod(moe.routing_layout)  # how the routers see a micro-batch (slime.training.moe)

    def _values(self, model, tokens, lengths) -> list[Tensor]:
        """Per-sample critic values of the response tokens (one pipeline stage): a list of Tensor[r_i]."""
        if not tokens:
            return []
        ids, pos, mask, prompt_lens = batch_inputs(tokens, lengths, self.device, seq_multiple=self.seq_multiple)
        with shims.cpu_only_cuda_shims():
            out = model(ids, pos, attention_mask=mask)  # [b, t, 1]
        return critic.response_values(out, ids, prompt_lens, lengths)[0]

    def forward_values(self, mb: MicroBatch, *, grad: bool = False) -> Tensor:
        """Critic values of every response token of this rank's micro-batch (value head only), Tensor[N]
        in sample order: response token t's value is the head's output at position t - 1, aligned
        with the log-probs (collective over the TP group, or the pipeline's)."""
        if not self.value_head:
            raise RuntimeError("forward_values needs a backend built with value_head=True")
        if grad and self.tp * self.pp > 1:
            raise RuntimeError("with tensor or pipeline parallelism, gradients go through train_step (the group's "
                               "losses are combined there)")
        if self.pp > 1:
            values, _ = self._pipeline_logprobs(self.model, mb, with_entropy=False)  # the pipeline scores values
            return values
        tokens, lengths, s, e = self._gather_tp(mb)
        with torch.set_grad_enabled(grad):
            values = self._values(self.model, tokens, lengths)
        return torch.cat(values[s:e]) if e > s else torch.zeros(0, device=self.device)

    # ------------------------------------------------------------ training

    def _group_max(self, n: int, group) -> int:
        if dist.get_world_size(group) == 1:
            return n
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t[0])

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn,
                   *, entropy_grad: bool = False) -> float:
        """Forward/backward every micro-batch, reduce gradients, clip, AdamW step, zero grad.
        loss_fn(k, log_probs Tensor[N_k], entropy Tensor[N_k]) as for FSDPBackend; the critic calls
        loss_fn(k, values Tensor[N_k], None).
        returns the total gradient norm before clipping (identical on every rank)."""
        n_local = len(micro_batches)
        entropy_grad = entropy_grad and not self.value_head
        if self.pp > 1:
            self._pipeline_backward(micro_batches, loss_fn, entropy_grad)
            return self._finish_step()
        # expert parallelism: every rank runs as many micro-batches (its EP ranks dispatch to each other)
        group = None if self.ep > 1 else self.tp_group
        for k in range(self._group_max(n_local, group)):
            mb = micro_batches[k] if k < n_local else MicroBatch([], [])
            if self.tp == 1:
                if not mb.tokens:
                    if self.ep > 1:  # the other EP ranks' token dispatch (forward and backward) needs this rank
                        moe.idle_forward(self.model, self.device, backward=True, seq_len=self.seq_multiple)
                    continue
                if self.value_head:  # the critic (dense models only: no routing)
                    loss_fn(k, self.forward_values(mb, grad=True), None).backward()
                    continue
                lp, ent = self.forward_logprobs(mb, grad=True, with_entropy=True, entropy_grad=entropy_grad)
                loss = loss_fn(k, lp, ent)
                aux = self.routing.training_forward(self.last_routing, *moe.routing_layout(mb))
                if aux is not None:  # --moe-aux-loss-coeff: the mean over the step's micro-batches, as fsdp
                    loss = loss + aux / n_local
                with shims.cpu_only_cuda_shims():  # the expert-parallel all-to-all's backward names the CUDA device
                    loss.backward()
                continue
            self._tp_backward(k, mb, loss_fn, entropy_grad, own=k < n_local, n_group=self._group_max(n_local, group))
        return self._finish_step()

    def _tp_backward(self, k, mb, loss_fn, entropy_grad: bool, own: bool, n_group: int) -> None:
        """One micro-batch under TP: one forward over the TP group's samples; the upstream gradient
        is the sum of every TP rank's d loss / d log-probs (and entropy) over its own slice. MoE: the
        load-balancing loss, the mean over the group's `n_group` micro-batches as without TP (x tp:
        every gradient is divided by the world size, and the group's micro-batch holds its tp ranks'
        samples), each TP rank's term over its part of the sequence."""
        tokens, lengths, s, e = self._gather_tp(mb)
        images = vision.group_images(mb, self.tp_group) if self.vl_config else None
        if not tokens:  # no sample in the TP group; the other EP ranks' token dispatch needs this rank
            if self.ep > 1:
                moe.idle_forward(self.model, self.device, backward=True, seq_len=self.seq_multiple)
            return
        aux = None
        if self.value_head:  # the critic: values in place of log-probs, no entropy
            lps, ents = self._values(self.model, tokens, lengths), None
        elif self._moe_routing():
            scale = self.tp / n_group if self.routing.aux_coef > 0 else None
            lps, ents, aux = moe.routed_tp_forward(self, mb, tokens, lengths, s, e, with_entropy=True,
                                                     entropy_grad=entropy_grad, count=True, aux_scale=scale)
        else:
            lps, ents = self._forward(self.model, tokens, lengths, with_entropy=True, entropy_grad=entropy_grad,
                                      images=images)
        if not lps:
            return
        lp_all, ent_all = torch.cat(lps), torch.cat(ents) if ents is not None else None
        g_lp, g_ent = self._upstream(k, lp_all, ent_all, lengths, s, e, loss_fn, entropy_grad, own, self.tp_group)
        outputs, upstream = [lp_all], [g_lp.to(lp_all.dtype)]
        if entropy_grad:
            outputs.append(ent_all)
            upstream.append(g_ent.to(ent_all.dtype))
        if aux is not None:
            outputs.append(aux)
            upstream.append(torch.ones_like(aux))
        with shims.cpu_only_cuda_shims():  # the sequence-parallel layers' backward names the CUDA device
            torch.autograd.backward(outputs, upstream)

    def _upstream(self, k, lp_all, ent_all, lengths, s, e, loss_fn, entropy_grad: bool, own: bool,
                  group) -> tuple[Tensor, Tensor | None]:
        """d loss / d log-probs (and entropy) of a group micro-batch: this rank's loss on its own slice
        [s, e) of the samples, summed over the group (disjoint slices)."""
        a, b = sum(lengths[:s]), sum(lengths[:e])
        g_lp = torch.zeros_like(lp_all, dtype=torch.float32)
        g_ent = torch.zeros_like(ent_all, dtype=torch.float32) if entropy_grad else None
        if own:
            lp_own = lp_all[a:b].detach().requires_grad_(True)
            ent_own = ent_all[a:b].detach().requires_grad_(entropy_grad) if ent_all is not None else None
            loss = loss_fn(k, lp_own, ent_own)
            inputs = [lp_own] + ([ent_own] if entropy_grad else [])
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
            if grads[0] is not None:
                g_lp[a:b] = grads[0]
            if entropy_grad and grads[1] is not None:
                g_ent[a:b] = grads[1]
        dist.all_reduce(g_lp, group=group)
        if entropy_grad:
            dist.all_reduce(g_ent, group=group)
        return g_lp, g_ent

    def _pipeline_backward(self, micro_batches, loss_fn, entropy_grad: bool) -> None:
        """Pipeline parallelism: every micro-batch of the group forward once to get the upstream
        gradients, then megatron's forward-backward schedule (pipeline.py says why two passes)."""
        n_local = len(micro_batches)
        gathered = []
        # under expert parallelism the pipelines of one stage's EP ranks dispatch tokens to each other in
        # every forward and backward: all of them run as many micro-batches (an empty one as a filler)
        for k in range(self._group_max(n_local, None if self.ep > 1 else self.mp_group)):
            mb = micro_batches[k] if k < n_local else MicroBatch([], [])
            gathered.append(gather_group_micro_batches([list(t) for t in mb.tokens], list(mb.response_lengths),
                                                       self.mp_group))
        batches = [(tokens, lengths) if tokens else FILLER for tokens, lengths, _, _ in gathered]
        if not batches:
            return
        moe_routing = self.routing if isinstance(self.routing, moe.MegatronRouting) else None
        routed = [moe.group_routed(micro_batches[k] if k < n_local else MicroBatch([], []), self.mp_group)
                  for k in range(len(batches))] if moe_routing else None
        aux = moe_routing is not None and moe_routing.aux_coef > 0
        with moe_routing.routing_pass(routed, aux_counts=aux) if moe_routing else contextlib.nullcontext() as rp:
            scores = self.pipeline.forward(self.chunks, batches, with_entropy=not self.value_head)
        upstream = [self._upstream(k, lp, ent, lengths, s, e, loss_fn, entropy_grad, k < n_local, self.mp_group)
                    for k, ((_, lengths, s, e), (lp, ent)) in enumerate(zip(gathered, scores))]
        # --moe-aux-loss-coeff: the mean over the micro-batches, as without PP (x tp x pp: the backend
        # divides every gradient by the world size, and one pipeline micro-batch holds its tp x pp ranks'
        # samples); under TP + SP each rank routes its part of the sequence: counts summed over TP x PP
        aux_terms = moe_routing.pipeline_aux(rp, batches, self.tp * self.pp / len(batches),
                                             self.mp_group) if aux else None
        # MoE: the same replay, the load-balancing loss and the usage metrics of the training pass
        with moe_routing.routing_pass(routed, count=True, aux=aux_terms) if moe_routing \
                else contextlib.nullcontext():
            self.pipeline.backward(self.chunks, batches, upstream)

    @property
    def chunks(self) -> list:
        return self._chunks(self.model)

    def _main(self):
        """--bf16: the parameters hold their fp32 main copies and gradients inside (precision.py)."""
        return self.main_params.main() if self.main_params is not None else contextlib.nullcontext()

    def _finish_step(self) -> float:
        with self._main():  # fp32 gradients reduced, clipped and stepped on the fp32 main copies
            grads.reduce_gradients(self.chunks, self._replica_group, self.world_size, self.tp_group, self.pp)
            experts = ps.get_expert_tensor_and_model_parallel_group() if self.ep * self.etp > 1 else None
            grad_norm = grads.global_norm(self.chunks, self.device, experts, self.mp_group)
            if math.isfinite(grad_norm):
                coef = min(self._max_grad_norm() / (grad_norm + 1e-6), 1.0)  # torch.nn.utils.clip_grad_norm_'s rule
                if coef < 1.0:
                    for p in self.model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(coef)
            return self._step_if_finite(grad_norm)

    # ------------------------------------------------------------ weights

    def _gather(self, t: Tensor) -> list[Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return parts

    def _mcore_full(self) -> dict[str, Tensor]:
        """{whole-model megatron name: full tensor}, every stage's layers, on every rank. Collective."""
        state = {}
        for chunk in self.chunks:
            state.update(full_mcore_state(chunk, self._gather))
        state = moe.gather_experts(state) if self.ep > 1 else state  # every EP rank's experts
        return gather_stages(state, self.device) if self.pp > 1 else state

    def _join_ranks(self, flat: dict[str, Tensor]) -> dict[str, Tensor]:
        """Every pipeline stage's and expert-parallel rank's entries of `flat`, on every rank. Collective."""
        flat = gather_stages(flat, self.device) if self.pp > 1 else flat
        return moe.gather_experts(flat) if self.ep > 1 else flat

    def _hf_full(self) -> dict[str, Tensor]:
        if self.value_head:  # HF token-classification names (score.weight), like FSDP's critic
            return critic.export(self._mcore_full(), self.hf_config)
        if self.vl_config is not None:  # the VL checkpoint's names, the vision tower's included
            return vision.to_hf(self._mcore_full(), lambda state: to_hf(state, self.hf_config))
        return to_hf(self._mcore_full(), self.hf_config)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) for every HF parameter, a tied head once (as the embedding), as the
        model computes with them (--bf16: the bf16 values). Collective over the TP group: every rank iterates."""
        yield from self._hf_full().items()

    def full_state(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """HF-named full model state (a tied head listed too, like HF's state_dict) and the AdamW
        state keyed by megatron name (full tensors) on rank 0; empty dicts elsewhere (--bf16: the fp32
        main copies). Collective."""
        with self._main():
            return self._full_state(optimizer)

    def _full_state(self, optimizer: bool) -> tuple[dict, dict | None]:
        sd = {k: v.detach().cpu().clone() for k, v in self._hf_full().items()}
        if getattr(self.hf_config, "tie_word_embeddings", False) and not self.value_head:
            sd["lm_head.weight"] = sd[(vision.LM_PREFIX if self.vl_config else "model.") + "embed_tokens.weight"]
        osd = full_optimizer_state(self.chunks, self.optimizer, self._gather, self._join_ranks) if optimizer else None
        if self.rank != 0:
            return {}, ({} if optimizer else None)
        return sd, osd

    def save(self, path: str | Path) -> None:
        """rank 0: `path/hf` (HF safetensors + config + tokenizer); every rank: its shards of the model
        and AdamW state in megatron's distributed checkpoint format under `path/train_state`, which
        any other layout (TP, PP, DP size, distributed optimizer or not) loads. Collective."""
        path = Path(path)
        with self._main():  # --bf16: the fp32 main copies (any run loads them, with or without --bf16)
            hf = self._hf_full()
            if self.rank == 0:
                self._write_hf(path / "hf", hf)
            del hf
            save_train_state(path / "train_state", self.chunks, self.optimizer)

    def load(self, path: str | Path) -> None:
        """Restore this rank's model shards and AdamW state from `path/train_state`, saved at any layout."""
        with self._main():
            load_train_state(Path(path) / "train_state", self.chunks, self.optimizer)

    def save_reference(self, path: Path) -> None:
        """--ref-update-interval: the reference model's shards, in the format of `save` (any layout loads them)."""
        save_train_state(path, self._chunks(self.ref_model))

    def load_reference(self, path: Path) -> None:
        load_train_state(path, self._chunks(self.ref_model))

    def _write_hf(self, out: Path, tensors: dict[str, Tensor]) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        if moe.is_moe(self.hf_config):  # the checkpoint's per-expert names, as save_pretrained writes them
            tensors = hf_checkpoint_names(self.hf_config, tensors)
        write_hf_dir(out, self.args.hf_checkpoint, self.vl_config or self.hf_config, tensors)

    def close(self) -> None:
        if self._owns_mp and ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
            self._owns_mp = False
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False
