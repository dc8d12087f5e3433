"""FSDP2 training backend over Hugging Face causal LMs.

`torch.distributed.fsdp.fully_shard` is applied to every decoder layer and to the
root model (which owns the embeddings, final norm and - tied or not - the LM head)
when there are two or more data-parallel ranks; a single rank trains the plain module
(nothing to shard, and FSDP2's per-micro-batch gathers, reduce-scatters and hooks would
only cost time).
Parameters stay fp32 (master weights); gloo on CPU, NCCL (+ gloo for CPU tensors)
on CUDA. The model is kept in eval mode throughout (no dropout), so a no-grad pass
and a training pass over the same weights give identical log-probs.

Sequence packing (default): a micro-batch is one row of all its samples' tokens, no
padding, with `position_ids` that restart at 0 for every sample and no attention
mask. transformers' masking utilities read the restarts as sequence boundaries and
build a block-diagonal causal mask (sdpa/eager; flash-attention would use varlen
kernels from the same `position_ids`, but it needs fp16/bf16 and the weights here are
fp32). Logits are computed only at the positions that score response tokens. At start
the backend checks once that the model honours packing (packed == separate forward of
two short sequences) and otherwise falls back to padded [B, T] rows with an attention
mask, as it does with `--disable-sequence-packing`.

Implements `slime.training.backend.TrainBackend`, the contract `TrainActor` calls.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForTokenClassification

from slime.algorithms.losses import (
    compute_entropy, compute_log_probs, compute_log_probs_and_entropy, log_probs_from_hidden,
)
from slime.training.backend import LossFn, MicroBatch, StepTail
from slime.training.fsdp import determinism, vision
from slime.training.fsdp.packed_attention import PACKED_SDPA, segment_kwargs
from slime.training import lora, lr_schedule
from slime.training.lr_schedule import LRSchedule
from slime.training.vision import IMAGE_MASK, has_images, padded_inputs
from slime.training.freeze import freeze_parameters
from slime.training.moe import TrainRouting
from slime.utils.checkpoint_data import dcp_load
from slime.utils.dist import init_process_group
from slime.utils.errors import SlimeConfigError
from slime.utils.hf_export import checkpoint_names, write_hf_dir
from slime.utils.net import node_address
from slime.utils.vision import VisionProcessor, is_vision_config, load_lm, own_memory

logger = logging.getLogger(__name__)

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


class FSDPBackend(StepTail):
    """One data-parallel rank of an FSDP2-sharded Hugging Face causal LM plus its optimizer."""

    def __init__(self, args, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, with_ref: bool = False, value_head: bool = False,
                 with_teacher: bool = False):
        self.args = args
        self.rank = rank
        self.world_size = world_size
        determinism.configure(args)  # --deterministic-mode: before any kernel runs
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        # log-probs are scored at the temperature the engine sampled with (SFT: the data's, T = 1)
        sft = args.loss_type == "sft_loss"
        self.temperature = args.rollout_temperature if args.rollout_temperature > 0 and not sft else 1.0

        self._owns_process_group = False
        if not dist.is_initialized():
            if master_port is None:
                raise ValueError("FSDPBackend needs master_port to create the process group")
            # the store and this rank's gloo sockets bind its node's address only (slime.utils.dist)
            init_process_group(self.device.type, rank, world_size, master_addr, master_port,
                               PROCESS_GROUP_TIMEOUT, bind_address=node_address())
            self._owns_process_group = True
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"process group has {dist.get_world_size()} ranks, expected {world_size}")

        self.hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
        self.value_head = value_head
        if value_head and is_vision_config(self.hf_config):  # the VL model with a 1-output head (vision.py)
            model = vision.load_critic(args.hf_checkpoint, dtype=torch.float32,
                                       attn_implementation=args.attn_implementation)
            self.hf_config = model.config
        elif value_head:  # PPO critic: the same backbone with a freshly initialized 1-output token head
            try:
                model = AutoModelForTokenClassification.from_pretrained(
                    args.hf_checkpoint, num_labels=1, dtype=torch.float32, attn_implementation=args.attn_implementation
                )
            except ValueError as e:
                raise ValueError(f"the PPO critic needs a token-classification head for model type "
                                 f"{self.hf_config.model_type!r} in transformers: {e}") from e
            self.hf_config = model.config
        else:
            # a frozen LoRA base needs no fp32 master copy: with --bf16 it is kept in bf16 (half the
            # memory); the adapters train in fp32 (FSDP2 needs one dtype among trainable parameters only)
            base_dtype = torch.bfloat16 if args.lora and args.bf16 else torch.float32
            model = load_lm(args.hf_checkpoint, dtype=base_dtype, attn_implementation=args.attn_implementation)
        model.eval()
        if self.device.type == "cuda":
            model.to(self.device)
        else:  # computes where it was loaded: sharded or not, the same numbers
            own_memory(model)
        self._supports_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # --lora-rank: peft adapters on the frozen base; the reference model is the same model with the
        # adapter switched off (slime.training.lora)
        self.lora = bool(args.lora) and not value_head
        if self.lora:
            model = lora.add_adapters(model, args)
        if args.freeze_params_name_list and not value_head:  # these parameters never train (before sharding)
            freeze_parameters(model, args.freeze_params_name_list)
        # One rank has nothing to shard: FSDP2 there would only add, to every micro-batch, an
        # all-gather and a reduce-scatter that copy every parameter and gradient, its per-module
        # hooks and DTensor dispatch in the optimizer (a third of a tiny model's step on CPU), for
        # the same numbers. So a single rank trains the plain module (the same math, bit for bit);
        # checkpoints stay DCP (by parameter name), so they resume on any number of ranks.
        if args.recompute_granularity == "full":  # before sharding: FSDP's hooks stay on the layer
            layers = _decoder_layers(model)
            for layer in layers[: args.recompute_num_layers if args.recompute_method == "block" else len(layers)]:
                _recompute_in_backward(layer)
        # --bf16: FSDP2's mixed precision (bf16 compute, fp32 master weights and optimizer state,
        # gradients reduced in fp32), so even one rank trains through FSDP2 then
        self.mixed_precision = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                                if args.bf16 else MixedPrecisionPolicy())
        # --optimizer-cpu-offload on a GPU: parameters (the fp32 master copy), gradients and AdamW
        # state live in pinned host memory and the optimizer steps there (FSDP2's CPU offload)
        offload = args.optimizer_cpu_offload and self.device.type == "cuda"
        if args.optimizer_cpu_offload and not offload and rank == 0:
            logger.info("--optimizer-cpu-offload: this run trains on the CPU, where the optimizer state already "
                        "is; nothing changes")
        self.sharded = world_size > 1 or args.bf16 or offload
        if self.sharded:
            mesh = init_device_mesh(self.device.type, (world_size,))
            policy = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=mesh, mp_policy=self.mixed_precision, offload_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=self.mixed_precision, offload_policy=policy)
        self.model = model
        # MoE models: the load-balancing loss, expert usage and routing replay of the policy's forwards
        self.routing = TrainRouting(model, 0.0 if value_head else args.moe_aux_loss_coeff)
        self.last_routing = None  # what the routers used in the last policy forward (slime.training.moe)
        self.pad_token_id = _pad_token_id(self.hf_config.get_text_config(decoder=True))
        # vision-language models: a micro-batch's images become pixel inputs and 3-D positions (vision.py)
        self.images = VisionProcessor(args.hf_checkpoint, config=self.hf_config) if is_vision_config(
            self.hf_config) else None
        # log-probs from the hidden states through the output layer chunk by chunk (no [tokens, vocab]
        # tensor), for models whose forward ends in that layer (checked once)
        self.hidden_head = bool(args.log_probs_chunk_size) and not value_head and self._head_is_last_step()
        self.pack = not args.disable_sequence_packing
        # packed rows attend one sample at a time (packed_attention) where that gives what separate
        # forwards give; else through the row's block-diagonal mask; else rows are padded
        self.segmented = self.pack and args.attn_implementation == "sdpa" and _set_attention(model, PACKED_SDPA)
        if self.segmented and not self._packing_is_exact():  # the check passes the segments' lengths
            self.segmented = False
            _set_attention(model, "sdpa")
        if self.pack and not self.segmented and not self._packing_is_exact():
            logger.warning("%s ignores packed position_ids here; training on padded rows instead",
                           type(model).__name__)
            self.pack = False
        if self.sharded:  # FSDP2 leaves the root's parameters unsharded after a forward; the optimizer needs the shards
            model.reshard()

        self.lr_schedule = LRSchedule.from_args(args, args.critic_lr if value_head else args.lr)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.lr_schedule.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
        )
        lr_schedule.start(self.lr_schedule, self.optimizer.param_groups)

        # frozen models: the KL reference (with LoRA: the policy with its adapter off) and the OPD teacher
        self.ref_model = self._frozen_model(args.ref_load or args.hf_checkpoint) if with_ref and not self.lora else None
        self.teacher_model = self._frozen_model(args.opd_teacher_load) if with_teacher else None

    def _frozen_model(self, path: str) -> torch.nn.Module:
        """A frozen model that scores the policy's tokens (the KL reference, the OPD teacher). Sharded
        like the policy (each rank holds 1/N of it; a forward gathers one layer at a time); on a GPU it
        also stays in host memory and comes to the device layer by layer, only for its forward."""
        ref = load_lm(path, dtype=torch.float32, attn_implementation=self.args.attn_implementation)
        if self.device.type != "cuda":
            own_memory(ref)
        ref.eval()
        ref.requires_grad_(False)
        if self.segmented and not _set_attention(ref, PACKED_SDPA):  # packed rows attend per sample there too
            raise SlimeConfigError(f"{path}: {type(ref).__name__} cannot attend one sample at a time in the "
                                   "policy's packed rows; train with --disable-sequence-packing")
        if not self.sharded and self.device.type != "cuda":
            return ref  # one CPU rank: nothing to shard, and the host is the device
        policy = CPUOffloadPolicy(pin_memory=True) if self.device.type == "cuda" else OffloadPolicy()
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in _decoder_layers(ref):
            fully_shard(layer, mesh=mesh, offload_policy=policy, mp_policy=self.mixed_precision)
        fully_shard(ref, mesh=mesh, offload_policy=policy, mp_policy=self.mixed_precision)
        return ref

    # ------------------------------------------------------------ forward

    def forward_logprobs(self, mb: MicroBatch, *, grad: bool = False, with_entropy: bool = False,
                         entropy_grad: bool = False, ref: bool = False,
                         teacher: bool = False) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and optionally entropy) of every response token of a micro-batch.

        mb: has `tokens: list[list[int]]` (prompt + response) and `response_lengths`.
        returns (log_probs Tensor[N], entropy Tensor[N] or None), N = sum(response_lengths),
        concatenated in sample order, fp32 on the model's device; response token t is
        scored by the logits at position t-1 divided by the rollout temperature.
        """
        if ref and self.lora:  # the reference is the base: the policy with its adapter switched off
            with torch.no_grad(), lora.adapter_disabled(self.model):
                return self._forward(self.model, mb, with_entropy=with_entropy, entropy_grad=False)
        model = self.teacher_model if teacher else self.ref_model if ref else self.model
        if model is None:
            raise RuntimeError(f"no {'teacher' if teacher else 'reference'} model was built")
        with torch.set_grad_enabled(grad and not (ref or teacher)):
            if model is self.model:  # the policy: MoE routing replayed (mb.routed_experts) and recorded
                with self.routing.forward(mb.routed_experts, *self.routing_layout(mb)) as self.last_routing:
                    out = self._forward(model, mb, with_entropy=with_entropy, entropy_grad=entropy_grad and grad)
            else:
                out = self._forward(model, mb, with_entropy=with_entropy, entropy_grad=entropy_grad and grad)
        if (ref or teacher) and isinstance(model, FSDPModule):
            model.reshard()  # FSDP2 keeps the root's parameters (embeddings, head) gathered after a forward
        return out

    def forward_values(self, mb: MicroBatch, *, grad: bool = False) -> Tensor:
        """Critic values of every response token of a micro-batch (value head models only).

        returns Tensor[N], N = sum(response_lengths), in sample order: response token t's value
        is the head's output at position t-1 (the state it is generated from), aligned with
        the log-probs of `forward_logprobs`.
        """
        if not self.value_head:
            raise RuntimeError("forward_values needs a backend built with value_head=True")
        with torch.set_grad_enabled(grad):
            if self.pack:
                inputs, score = self._pack(mb)
                out, _ = self._head_inputs(self.model, **inputs)  # a value head: its outputs, the values
                if score.numel() == 0:
                    return out.new_zeros(0, dtype=torch.float32) + 0.0 * out.sum()
                return out[0, score, 0].float()
            ids, attn, prompt_lens = self._pad(mb)
            images = padded_inputs(self.model, self.images, mb.images, ids, attn) if has_images(mb.images) else {}
            out = self._head_inputs(self.model, input_ids=ids, attention_mask=attn, use_cache=False, **images)[0][..., 0]
            values = torch.cat([out[i, p - 1 : p - 1 + r] for i, (p, r) in
                                enumerate(zip(prompt_lens, mb.response_lengths))])
            if values.numel() == 0 and torch.is_grad_enabled():
                values = values + 0.0 * out.sum()
            return values.float()

    def routing_layout(self, mb) -> tuple[list[int], bool, int]:
        """How the routers see a micro-batch's tokens: (sample lengths, one packed row, padded width)."""
        lens = [len(t) for t in mb.tokens]
        return lens, self.pack, max(lens)

    @staticmethod
    def _layout(mb) -> tuple[list[int], list[int]]:
        """Token counts and prompt lengths of a micro-batch's samples (validated)."""
        lens = [len(t) for t in mb.tokens]
        if not lens:
            raise ValueError("empty micro-batch")
        prompt_lens = [n - r for n, r in zip(lens, mb.response_lengths)]
        for i, (p, r) in enumerate(zip(prompt_lens, mb.response_lengths)):
            if p < 1 or r < 0:
                raise ValueError(f"sample {i} of the micro-batch: {lens[i]} tokens, response length {r} "
                                 "(a response needs at least one prompt token before it)")
        return lens, prompt_lens

    def _pack(self, mb) -> tuple[dict, Tensor]:
        """One packed row: the model's inputs (input ids [1, N], position ids [1, N] restarting per
        sample, the samples' lengths for per-sample attention), and the positions
        (Tensor[sum(response_lengths)]) whose logits score the response tokens, in sample order
        (response token t of a sample is scored at its position t - 1)."""
        lens, prompt_lens = self._layout(mb)
        ids = torch.as_tensor([tok for toks in mb.tokens for tok in toks], dtype=torch.long)
        pos = torch.cat([torch.arange(n) for n in lens])
        score, offset = [], 0
        for n, p, r in zip(lens, prompt_lens, mb.response_lengths):
            score.append(torch.arange(offset + p - 1, offset + p - 1 + r))
            offset += n
        inputs = {"input_ids": ids[None].to(self.device), "position_ids": pos[None].to(self.device),
                  "use_cache": False, **self._segment_kwargs(lens)}
        if has_images(mb.images):
            inputs.update(vision.packed_inputs(self.model, self.images, mb, inputs["input_ids"], lens))
        return inputs, torch.cat(score).to(self.device)

    def _segment_kwargs(self, lens: list[int]) -> dict:
        return segment_kwargs(lens) if self.segmented else {}

    @torch.no_grad()
    def _head_is_last_step(self) -> bool:
        """Whether the model's logits are its output layer (a bias-free linear layer) applied to what
        reaches it, with nothing after (no soft-capping or scaling): checked on a tiny input
        (collective: every rank runs the same forwards)."""
        head = self.model.get_output_embeddings()
        vocab = int(getattr(self.hf_config.get_text_config(decoder=True), "vocab_size", 0) or 0)
        if not isinstance(head, torch.nn.Linear) or head.bias is not None or vocab < 2:
            return False
        ids = torch.randint(1, vocab, (1, 6), generator=torch.Generator().manual_seed(4321)).to(self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0].float()
        self.hidden_head = True
        try:
            hidden, weight = self._head_inputs(self.model, input_ids=ids, use_cache=False)
        finally:
            self.hidden_head = False
        if hidden.shape[-1] != weight.shape[-1]:
            return False
        again = torch.nn.functional.linear(hidden[0], weight).float()
        tol = 2e-2 if self.args.bf16 else 1e-5  # bf16: the same op, another blocking may round differently
        return bool((again - logits).abs().max() <= tol * (float(logits.abs().max()) + 1.0))

    @torch.no_grad()
    def _packing_is_exact(self) -> bool:
        """Whether a packed row gives the same outputs as separate forwards (collective: every
        rank runs the same tiny forwards)."""
        vocab = int(getattr(self.hf_config.get_text_config(decoder=True), "vocab_size", 0) or 0)
        if vocab < 2:
            return False
        g = torch.Generator().manual_seed(1234)
        seqs = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 3, 6)]
        ids = torch.as_tensor([t for s in seqs for t in s], dtype=torch.long)[None].to(self.device)
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(self.device)
        try:
            packed = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                                **self._segment_kwargs([len(s) for s in seqs])).logits[0].float()
        except Exception as e:  # noqa: BLE001 - any failure means: do not pack
            logger.warning("packed forward failed (%s: %s)", type(e).__name__, e)
            return False
        alone = torch.cat([self.model(input_ids=torch.as_tensor(s, device=self.device)[None],
                                      use_cache=False).logits[0].float() for s in seqs])
        scale = float(alone.abs().max()) + 1.0
        return bool((packed - alone).abs().max() <= (3e-2 if self.args.bf16 else 1e-4) * scale)

    def _pad(self, mb) -> tuple[Tensor, Tensor, list[int]]:
        lens, prompt_lens = self._layout(mb)
        b, t = len(lens), max(lens)
        ids = torch.full((b, t), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((b, t), dtype=torch.long)
        for i, toks in enumerate(mb.tokens):
            ids[i, : lens[i]] = torch.as_tensor(toks, dtype=torch.long)
            attn[i, : lens[i]] = 1
        return ids.to(self.device), attn.to(self.device), prompt_lens

    def _head_inputs(self, model, **inputs) -> tuple[Tensor, Tensor | None]:
        """The model's forward: (logits, None), or with the chunked output layer (hidden states of
        the same positions, the output layer's weight), so no full [tokens, vocab] tensor exists."""
        images = vision.images_only(model, inputs.pop(IMAGE_MASK, None))
        if not self.hidden_head:
            with images:
                return model(**inputs).logits, None
        head = model.get_output_embeddings()
        head.forward = _identity  # the causal LM's last step is head(hidden): it hands back the hidden states
        try:
            with images:
                hidden = model(**inputs).logits
        finally:
            del head.forward
        return hidden, head.weight

    def _scores(self, x: Tensor, weight: Tensor | None, tgt: Tensor, *, with_entropy: bool,
                entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropy) of `tgt` from the rows of logits, or of hidden states and the
        output layer's weight (slime.algorithms.losses.log_probs_from_hidden)."""
        if weight is not None:
            return log_probs_from_hidden(x, weight, tgt, self.temperature, self.args.log_probs_chunk_size,
                                         with_entropy=with_entropy, entropy_grad=entropy_grad)
        if with_entropy and entropy_grad:
            return compute_log_probs_and_entropy(x, tgt, self.temperature)
        log_probs = compute_log_probs(x, tgt, self.temperature)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = compute_entropy(x.detach(), self.temperature)
        return log_probs, entropy

    def _forward_packed(self, model, mb, *, with_entropy: bool, entropy_grad: bool):
        inputs, score = self._pack(mb)
        ids = inputs["input_ids"]
        keep = score if score.numel() else 1  # no response token: keep the graph (FSDP) with one position
        if self._supports_logits_to_keep:
            x, weight = self._head_inputs(model, **inputs, logits_to_keep=keep)
            x = x[0]
        else:
            x, weight = self._head_inputs(model, **inputs)
            x = x[0][score] if score.numel() else x[0][-1:]
        if not score.numel():
            log_probs = x.new_zeros(0, dtype=torch.float32)
            if torch.is_grad_enabled():
                log_probs = log_probs + 0.0 * x.sum()
            return log_probs, (log_probs.detach().clone() if with_entropy else None)
        return self._scores(x, weight, ids[0, score + 1], with_entropy=with_entropy, entropy_grad=entropy_grad)

    def _forward(self, model, mb, *, with_entropy: bool, entropy_grad: bool):
        if self.pack:
            return self._forward_packed(model, mb, with_entropy=with_entropy, entropy_grad=entropy_grad)
        ids, attn, prompt_lens = self._pad(mb)
        b, t = ids.shape

        # logits are needed from the first position that scores a response token on
        start = min(p - 1 for p in prompt_lens) if self._supports_logits_to_keep else 0
        kwargs = {"logits_to_keep": t - start} if self._supports_logits_to_keep else {}
        if has_images(mb.images):
            kwargs.update(padded_inputs(model, self.images, mb.images, ids, attn))
        x, weight = self._head_inputs(model, input_ids=ids, attention_mask=attn, use_cache=False, **kwargs)

        lps, ents = [], []
        for i in range(b):
            p, r = prompt_lens[i], mb.response_lengths[i]
            rows = x[i, p - 1 - start : p - 1 - start + r]  # [r, V] logits or [r, H] hidden states, a view
            lp, ent = self._scores(rows, weight, ids[i, p : p + r], with_entropy=with_entropy,
                                   entropy_grad=entropy_grad)
            lps.append(lp)
            ents.append(ent)
        log_probs = torch.cat(lps)
        if log_probs.numel() == 0 and torch.is_grad_enabled():
            # keep every parameter in the graph so FSDP's backward collectives still run
            log_probs = log_probs + 0.0 * x.sum()
        entropy = torch.cat(ents) if with_entropy else None
        return log_probs, entropy

    # ------------------------------------------------------------ training

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn,
                   *, entropy_grad: bool = False) -> float:
        """Forward/backward every micro-batch, clip, optimizer step, zero grad.

        loss_fn(k, log_probs Tensor[N_k], entropy Tensor[N_k]) -> scalar loss of micro-batch k,
        already scaled for accumulation (the backend only sums gradients). A value-head
        backend calls loss_fn(k, values Tensor[N_k], None).
        returns the total gradient norm before clipping (identical on every rank).
        """
        if self.lora:
            lora.set_dropout_training(self.model, True)  # --lora-dropout acts in the training forward only
        try:
            for k, mb in enumerate(micro_batches):
                if self.value_head:
                    lp, ent = self.forward_values(mb, grad=True), None
                else:
                    lp, ent = self.forward_logprobs(mb, grad=True, with_entropy=True, entropy_grad=entropy_grad)
                loss = loss_fn(k, lp, ent)
                aux = self.routing.training_forward(self.last_routing, *self.routing_layout(mb))
                if aux is not None:  # --moe-aux-loss-coeff: the mean over the step's micro-batches
                    loss = loss + aux / len(micro_batches)
                loss.backward()
        finally:
            if self.lora:
                lora.set_dropout_training(self.model, False)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self._max_grad_norm())
        return self._step_if_finite(_full(grad_norm).item())

    # ------------------------------------------------------------ weights

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) for every parameter, tied ones once (with LoRA: the base with the
        adapter merged in). Collective: all ranks iterate."""
        if self.lora:
            yield from lora.merged_weights(self.model)
            return
        for name, p in self.model.named_parameters():
            yield name, _full(p.detach()).contiguous()

    def base_weights(self) -> Iterator[tuple[str, Tensor]]:
        """With LoRA: (HF name, full tensor) of the frozen base alone, what engines that hold the
        adapter separately serve as their weights. Collective."""
        return lora.merged_weights(self.model, merge=False)

    def adapter_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(peft name, full tensor) of the LoRA adapter's tensors. Collective."""
        return lora.adapter_weights(self.model)

    def adapter_config(self) -> dict:
        """The LoRA adapter's peft config (`adapter_config.json`)."""
        return lora.adapter_config(self.model)

    def full_state(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """Full (unsharded) model and optimizer state dicts on CPU; rank 0 gets them, others
        get empty dicts. Collective."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if optimizer:
            return get_state_dict(self.model, self.optimizer, options=opts)
        return get_model_state_dict(self.model, options=opts), None

    def save(self, path: str | Path) -> None:
        """rank 0: `path/hf` (HF safetensors + config + tokenizer), with LoRA `path/adapter` (peft's
        format) instead; all ranks: `path/train_state` (DCP; with LoRA the adapter and its optimizer)."""
        path = Path(path)
        if self.lora:
            tensors = dict(self.adapter_weights())
            if self.rank == 0:
                lora.write_adapter(path / "adapter", tensors, self.adapter_config())
            del tensors
        else:
            model_sd, _ = self.full_state(optimizer=False)
            if self.rank == 0:
                self._write_hf(path / "hf", model_sd)
            del model_sd
        msd, osd = get_state_dict(self.model, self.optimizer, options=self._state_options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / "train_state"))
        if self.world_size > 1:
            dist.barrier()

    def load(self, path: str | Path) -> None:
        """Restore model and optimizer state from `path/train_state` (any DP size)."""
        state_dir = Path(path) / "train_state"
        if not state_dir.is_dir():
            raise FileNotFoundError(f"no training state at {state_dir}")
        msd, osd = get_state_dict(self.model, self.optimizer, options=self._state_options)
        state = {"model": msd, "optim": osd}
        dcp_load(state, state_dir)  # data only: no pickle in the checkpoint runs code (slime.utils.checkpoint_data)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._state_options)
        if self.world_size > 1:
            dist.barrier()

    @property
    def _state_options(self) -> StateDictOptions:
        """The training state: with LoRA only the adapter (the frozen base is --hf-checkpoint)."""
        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.lora else StateDictOptions()

    def _write_hf(self, out: Path, state_dict: dict[str, Tensor]) -> None:
        # parameters once (a tied LM head is saved as the embedding only) + persistent buffers
        keep = {n for n, _ in self.model.named_parameters()}
        keep |= {n for n, _ in self.model.named_buffers() if n in state_dict}
        tensors = {k: v.contiguous() for k, v in state_dict.items() if k in keep}
        missing = keep - set(tensors)
        if missing:
            raise RuntimeError(f"full state dict lacks {sorted(missing)[:5]}")
        write_hf_dir(out, self.args.hf_checkpoint, self.hf_config, checkpoint_names(self.model, tensors))

    def close(self) -> None:
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _identity(x: Tensor) -> Tensor:
    return x


def _recompute_in_backward(layer: torch.nn.Module) -> None:
    """Activation recompute of one decoder layer (--recompute-granularity full): with gradients,
    its forward keeps only its inputs and runs again in backward (torch's non-reentrant
    checkpoint); the module, its parameter names and its FSDP hooks are unchanged."""
    forward = layer.forward

    def recomputed(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    layer.forward = recomputed


def _set_attention(model: torch.nn.Module, implementation: str) -> bool:
    """Switch a Hugging Face model's attention implementation (read by every attention layer at
    each forward); False where the model has no such setting."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return False
    config._attn_implementation = implementation
    return True


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a HF causal LM (each gets its own FSDP unit)."""
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in no_split]
    if layers:
        return layers
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    return list(layers) if layers is not None else []


def _pad_token_id(config) -> int:
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        v = getattr(config, name, None)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0
