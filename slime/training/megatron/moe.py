"""Mixture of experts on the megatron backend: Qwen3-MoE, Mixtral and Qwen2-MoE as megatron-core
MoE layers (local spec: `TopKRouter`, `SequentialMLP` experts, no grouped GEMM), their HF weights,
expert parallelism and the routing hook. Imports megatron-core at the top, like backend.py.

Model. `transformer_config(config, dtype, ep)`: the dense config of the same attention
(convert.py, with the MoE family's dense twin: qwen3_moe -> qwen3, qwen2_moe -> qwen2,
mixtral -> llama) plus megatron's MoE fields: `num_moe_experts`, `moe_router_topk`,
`moe_ffn_hidden_size`, and the router math of the HF block:
  * top-k of the softmax, renormalized (Qwen3-MoE `norm_topk_prob`, Mixtral always): megatron's
    `moe_router_pre_softmax=False` (top-k of the logits, softmax over the k), the same numbers;
  * top-k of the softmax, not renormalized (Qwen2-MoE / Qwen3-MoE without `norm_topk_prob`):
    `moe_router_pre_softmax=True`;
  * Qwen2-MoE's shared expert and its sigmoid gate: `moe_shared_expert_intermediate_size` and
    `moe_shared_expert_gate` (megatron's SharedExpertMLP: sigmoid(x . gate_weight) x SwiGLU(x),
    HF's `sigmoid(shared_expert_gate(x)) * shared_expert(x)`).
megatron's own load-balancing loss is off (`moe_aux_loss_coeff=0`): slime adds the Hugging Face
formula itself (slime.training.moe.TrainRouting), so both backends add the same loss.

Weights (HF names as transformers 5 holds them in memory: a layer's experts fused into
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]):
    mlp.gate.weight                          mlp.router.weight
    mlp.experts.gate_up_proj[e]              mlp.experts.local_experts.<j>.linear_fc1.weight
    mlp.experts.down_proj[e]                 mlp.experts.local_experts.<j>.linear_fc2.weight
    mlp.shared_expert.{gate,up}_proj         mlp.shared_experts.linear_fc1.weight (gate rows, then up)
    mlp.shared_expert.down_proj              mlp.shared_experts.linear_fc2.weight
    mlp.shared_expert_gate.weight            mlp.shared_experts.gate_weight
With `--expert-model-parallel-size P` EP rank r holds the experts r*E/P .. (r+1)*E/P - 1 as its
local experts 0 .. E/P - 1: `global_expert_names` gives them their global ids, so the whole-model
megatron names are those of one rank holding every expert.

Routing (`MegatronRoutingHook`): the same interface as slime.utils.moe_routing.RoutingHook, so
`TrainRouting` (aux loss, usage metrics, R2/R3 replay) runs unchanged. It puts an object with the
interface of megatron's `RouterReplay` (`get_replay_topk`, the hook megatron's top-k calls) on
every router: it records the experts chosen and, when replaying, forces the given experts (a row
of -1 keeps the router's choice). megatron's routers see tokens in (position, sample) order; the
hook converts to and from slime's (sample, position) order.

Pipeline parallelism: a stage builds its own MoE layers (whole-model names through
weights.global_names); `MegatronRouting.routing_pass` / `before_forward` give each micro-batch's
forward its real tokens (usage metrics), its replayed experts (R2/R3) and keep what the routers chose
(R2's recording, joined over the stages by `joined_recording`) and attach each layer's share of
the load-balancing loss (`pipeline_aux`). Expert parallelism is not built with it yet (refused at
parse time, slime.moe_flags).

Tensor parallelism (with sequence parallelism, which megatron's MoE layers require): each TP rank's
routers route its part of the sequence (`MegatronRoutingHook.sp_rank`); the same per-forward state
covers the TP group's micro-batch, sliced to the rank's positions, and `local_aux_term` gives the
rank's share of the load-balancing loss. The experts are split over the TP group (expert tensor
parallelism = TP, megatron's default: the dispatcher gathers the group's tokens, weights.py splits
the expert weights like the dense MLP's) or whole on every TP rank (expert tensor parallelism 1).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor

from slime.training.megatron import convert as mc
from slime.training.megatron import shims
from slime.training.moe import TrainRouting, replay_rows
from slime.utils.errors import SlimeConfigError, SlimeError
from slime.utils.moe_routing import Recording

DENSE_TWIN = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "llama"}
_EXPERT = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def is_moe(config) -> bool:
    return getattr(config, "model_type", None) in DENSE_TWIN


def num_experts(config) -> int:
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts"))


def expert_ffn(config) -> int:
    return int(config.intermediate_size if config.model_type == "mixtral" else config.moe_intermediate_size)


def shared_ffn(config) -> int:
    return int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if config.model_type == "qwen2_moe" else 0


def renormalizes(config) -> bool:
    return config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))


def dense_twin(config):
    """The config with the MoE family's dense model type: what convert.py maps (attention, norms)."""
    twin = copy.deepcopy(config)
    twin.model_type = DENSE_TWIN[config.model_type]
    twin.intermediate_size = expert_ffn(config)
    return twin


def check_moe_config(config, tp: int, pp: int, ep: int, etp: int = 1) -> None:
    """Refuse what this module does not build, one line each."""
    mt = config.model_type
    if getattr(config, "mlp_only_layers", None) or int(getattr(config, "decoder_sparse_step", 1) or 1) != 1:
        raise SlimeConfigError(f"{mt}: dense layers between the MoE layers (mlp_only_layers / decoder_sparse_step) "
                               "are not built on the megatron backend; use --train-backend fsdp")
    if num_experts(config) % ep:
        raise SlimeConfigError(f"--expert-model-parallel-size {ep} must divide the model's {num_experts(config)} "
                               "experts")
    if expert_ffn(config) % etp:
        raise SlimeConfigError(f"--expert-tensor-parallel-size {etp} must divide the experts' intermediate size "
                               f"({expert_ffn(config)})")


def transformer_config(config, dtype, ep: int = 1, etp: int = 1):
    """megatron's TransformerConfig of an HF MoE config (see the module docstring); `ep` / `etp`: the
    expert-parallel and expert-tensor-parallel sizes."""
    shims.define_missing_te_gemm()
    shims.cpu_alltoall_dispatcher()
    base = mc.transformer_config(dense_twin(config), dtype)
    fields = dict(num_moe_experts=num_experts(config), moe_router_topk=int(config.num_experts_per_tok),
                  moe_ffn_hidden_size=expert_ffn(config), moe_router_pre_softmax=not renormalizes(config),
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                  moe_token_dispatcher_type="alltoall" if ep > 1 else "allgather",
                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if shared_ffn(config):
        fields.update(moe_shared_expert_intermediate_size=shared_ffn(config), moe_shared_expert_gate=True)
    return dataclasses.replace(base, **fields)


def check_convertible(config) -> None:
    """What tools/convert_*torch_dist* map, one line when not: a dense family of convert.py, or an
    MoE family of this module with every layer MoE."""
    mt = getattr(config, "model_type", None)
    if is_moe(config):
        check_moe_config(config, tp=1, pp=1, ep=1)
        mc.check_config(dense_twin(config))
    elif mt not in mc.SUPPORTED_MODEL_TYPES:
        raise SlimeError(f"model_type {mt!r} is not supported (supported: "
                         f"{', '.join((*mc.SUPPORTED_MODEL_TYPES, *DENSE_TWIN))})")
    else:
        mc.check_config(config)


def build_gpt_model(config, vocab_rows: int, dtype):
    """convert.build_gpt_model for an MoE config: the whole model on one process (EP 1) with
    megatron's MoE layers; needs convert.single_process_parallel_state()."""
    return mc.build_gpt_model(dense_twin(config), vocab_rows, dtype, moe_config=transformer_config(config, dtype),
                              num_experts=num_experts(config))


# ------------------------------------------------------------------ weights

def _ep() -> tuple[int, int]:
    return ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()


def ep_rank() -> int:
    return _ep()[1]


def is_expert(name: str) -> bool:
    return _EXPERT.fullmatch(name) is not None


def global_expert_name(name: str, local_experts: int, ep_rank: int) -> str:
    m = _EXPERT.fullmatch(name)
    return f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}{m.group(3)}" if m else name


def hf_to_mcore(state: dict, config, vocab_rows: int | None) -> dict:
    """Fused HF state -> the whole-model megatron state (every expert, global ids)."""
    state = dict(state)
    out = {}
    for i in range(config.num_hidden_layers):
        h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        try:
            out[m + "router.weight"] = state.pop(h + "gate.weight")
            gate_up, down = state.pop(h + "experts.gate_up_proj"), state.pop(h + "experts.down_proj")
        except KeyError as e:
            raise SlimeError(f"HF checkpoint has no {e.args[0]}") from None
        for e in range(gate_up.shape[0]):
            out[f"{m}experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e].contiguous()
            out[f"{m}experts.local_experts.{e}.linear_fc2.weight"] = down[e].contiguous()
        if shared_ffn(config):
            out[m + "shared_experts.linear_fc1.weight"] = torch.cat(
                [state.pop(h + "shared_expert.gate_proj.weight"), state.pop(h + "shared_expert.up_proj.weight")])
            out[m + "shared_experts.linear_fc2.weight"] = state.pop(h + "shared_expert.down_proj.weight")
            out[m + "shared_experts.gate_weight"] = state.pop(h + "shared_expert_gate.weight")
    out.update(mc.hf_to_mcore(state, dense_twin(config), vocab_rows=vocab_rows, mlp=False))
    return out


def mcore_to_hf(state: dict, config, vocab_size: int | None) -> dict:
    """The whole-model megatron state -> fused HF state (the names transformers holds in memory)."""
    state = dict(state)
    out = {}
    n = num_experts(config)
    for i in range(config.num_hidden_layers):
        h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        out[h + "gate.weight"] = state.pop(m + "router.weight")
        out[h + "experts.gate_up_proj"] = torch.stack(
            [state.pop(f"{m}experts.local_experts.{e}.linear_fc1.weight") for e in range(n)])
        out[h + "experts.down_proj"] = torch.stack(
            [state.pop(f"{m}experts.local_experts.{e}.linear_fc2.weight") for e in range(n)])
        if shared_ffn(config):
            gate, up = torch.chunk(state.pop(m + "shared_experts.linear_fc1.weight"), 2, dim=0)
            out[h + "shared_expert.gate_proj.weight"], out[h + "shared_expert.up_proj.weight"] = \
                gate.contiguous(), up.contiguous()
            out[h + "shared_expert.down_proj.weight"] = state.pop(m + "shared_experts.linear_fc2.weight")
            out[h + "shared_expert_gate.weight"] = state.pop(m + "shared_experts.gate_weight")
    out.update(mc.mcore_to_hf(state, dense_twin(config), vocab_size=vocab_size, mlp=False))
    return out


def gather_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state` (whole-model names) with every EP rank's experts; collective over the EP group."""
    ep, _ = _ep()
    if ep == 1:
        return state
    mine = {k: v.detach().cpu() for k, v in state.items() if is_expert(k.split("/")[0])}  # "name[/moment]"
    parts: list = [None] * ep
    dist.all_gather_object(parts, mine, group=ps.get_expert_model_parallel_group())
    device = next(iter(state.values())).device if state else torch.device("cpu")
    out = dict(state)
    for p in parts:
        out.update({k: v.to(device) for k, v in p.items()})
    return out


# ------------------------------------------------------------------ routing

class _Replay:
    """Duck-typed megatron `RouterReplay` of one router: megatron's top-k calls `get_replay_topk`."""

    def __init__(self, hook: "MegatronRoutingHook", layer: int):
        self.hook, self.layer = hook, layer
        self.target: Tensor | None = None  # [N, K] in megatron's token order; -1 rows: the router's choice
        self.chosen: Tensor | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        vals, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is not None:
            forced = self.target.to(idx.device).long()
            keep = (forced >= 0).all(dim=-1, keepdim=True)
            idx = torch.where(keep, forced, idx)
            vals = scores.gather(1, idx)
        self.chosen = idx
        return vals, idx


class _AttachLoss(torch.autograd.Function):
    """`out` unchanged; in backward `loss` gets gradient 1 (megatron's MoEAuxLossAutoScaler without its
    global scale): a loss term joins the backward of the tensor it is attached to."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor) -> Tensor:
        ctx.save_for_backward(loss)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class MegatronRoutingHook:
    """slime.utils.moe_routing.RoutingHook's interface over a megatron-core model's TopKRouters."""

    def __init__(self, model: torch.nn.Module, model_layers: int | None = None):
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.num_layers = len(self.routers)
        # the whole model's MoE layer of each router (every decoder layer is MoE: check_moe_config);
        # under pipeline parallelism this rank's routers are some of them. Replayed rows are the whole
        # model's [tokens, model_layers, K]; each router takes its own layer's column
        self.layer_ids = [int(r.layer_number) - 1 for r in self.routers]
        self.model_layers = model_layers or self.num_layers
        self._usage: Tensor | None = None  # counting(): [model layers, experts] routed slots
        self._real: Tensor | None = None  # the current forward's real tokens, (position, sample) order
        self._captured: dict | None = None  # pipeline passes: (micro-batch, model layer) -> chosen
        self._k: int | None = None  # the micro-batch of the current pipeline forward
        self._aux_counts: dict | None = None  # pipeline: micro-batch -> [E] slots routed to each expert
        self._aux: tuple | None = None  # pipeline: (counts [n, E], real tokens [n], coefficient) to attach
        self._aux_logits: dict | None = None  # TP: (micro-batch, model layer) -> (router logits, real tokens)
        # sequence parallelism: this TP rank's routers see positions [rank * t / size, (rank + 1) * t / size)
        sp = bool(self.routers) and self.routers[0].config.sequence_parallel
        self.sp_size = ps.get_tensor_model_parallel_world_size() if sp else 1
        self.sp_rank = ps.get_tensor_model_parallel_rank() if sp else 0
        self.top_k = int(self.routers[0].topk) if self.routers else 0
        self.num_experts = int(self.routers[0].config.num_moe_experts) if self.routers else 0
        self._recording: Recording | None = None
        self._replay: Tensor | None = None
        for layer, router in enumerate(self.routers):
            router.router_replay = _Replay(self, layer)
            router.routing = self._wrap(router, layer, router.routing)

    def _wrap(self, router, layer: int, routing):
        def wrapped(logits: Tensor, padding_mask=None):
            s, b = logits.shape[:2]
            replay = router.router_replay
            replay.target = None
            if self._replay is not None:  # slime's rows are (sample, position); megatron's (position, sample)
                rows = self._replay[:, self.layer_ids[layer]]
                replay.target = rows.reshape(b, s, -1).transpose(0, 1).reshape(s * b, -1)
            out = routing(logits, padding_mask=padding_mask)
            if self._captured is not None:
                self._captured[(self._k, self.layer_ids[layer])] = replay.chosen.detach().to(torch.int32)
            if self._real is not None and (self._usage is not None or self._aux_counts is not None):
                chosen = replay.chosen[self._real.to(replay.chosen.device)].reshape(-1)
                counts = torch.bincount(chosen, minlength=self.num_experts).cpu().float()
                if self._usage is not None:
                    self._usage[self.layer_ids[layer]] += counts
                if self._aux_counts is not None:
                    self._aux_counts[self._k] = self._aux_counts.get(self._k, 0) + counts
            if self._aux_logits is not None and self._real is not None:
                self._aux_logits[(self._k, self.layer_ids[layer])] = (logits.reshape(s * b, -1), self._real)
            if self._aux is not None and self._real is not None and self._real.any():
                out = (_AttachLoss.apply(out[0], self._stage_aux_term(logits)), *out[1:])
            if self._recording is not None:
                idx = replay.chosen.reshape(s, b, -1).transpose(0, 1).reshape(b * s, -1)
                # (sample, position) rows by index (its backward is a contiguous gradient, as megatron's needs)
                order = torch.arange(s * b, device=logits.device).reshape(s, b).t().reshape(-1)
                lg = logits.reshape(s * b, -1).index_select(0, order)
                self._recording._add(layer, idx.to(torch.int32), lg)
            replay.target = replay.chosen = None
            return out
        return wrapped

    def _stage_aux_term(self, logits: Tensor) -> Tensor:
        """This layer's share of the current micro-batch's load-balancing loss (see MegatronRouting)."""
        counts, tokens, coef = self._aux
        real = self._real.to(logits.device)
        probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)[real]  # [T, E]
        n = self.model_layers * float(tokens[self._k])
        return coef * self.num_experts / (n * n) * (probs.sum(dim=0) * counts[self._k].to(probs.device)).sum()

    @contextlib.contextmanager
    def recording(self):
        self._recording = rec = Recording()
        try:
            yield rec
        finally:
            self._recording = None

    @contextlib.contextmanager
    def replaying(self, indices: Tensor):
        if indices.dim() != 3 or indices.shape[1] != self.model_layers or indices.shape[2] != self.top_k:
            raise ValueError(f"routing replay: expected [tokens, {self.model_layers}, {self.top_k}] expert ids, "
                             f"got {tuple(indices.shape)}")
        self._replay = indices
        try:
            with self.recording() as rec:
                yield rec
        finally:
            self._replay = None


@dataclasses.dataclass
class _PipelinePass:
    """What the routers left in one pipeline pass (MegatronRouting.routing_pass)."""
    captured: dict = dataclasses.field(default_factory=dict)  # (micro-batch, model layer) -> chosen
    aux_counts: dict = dataclasses.field(default_factory=dict)  # micro-batch -> [E] routed slots, this stage
    aux_logits: dict = dataclasses.field(default_factory=dict)  # (micro-batch, layer) -> (logits, real tokens)


class MegatronRouting(TrainRouting):
    """TrainRouting over a megatron-core model (the hook above in place of the HF one).

    Under pipeline parallelism a stage's routers are some of the model's layers and megatron's
    schedule runs the micro-batches' forwards in its own order, so the per-forward state is set by
    `before_forward` (pipeline.py calls it before each micro-batch's forward on each stage) inside a
    `routing_pass`: the forward's real tokens (usage counts), the experts to replay (R2/R3: every
    sample's rows of the whole model, each router taking its own layer's) and what the routers chose
    (R2's recording, `joined_recording`)."""

    def __init__(self, model: torch.nn.Module, aux_coef: float = 0.0, model_layers: int | None = None):
        self.hook = MegatronRoutingHook(model, model_layers)
        self.enabled = self.hook.num_layers > 0
        self.aux_coef = float(aux_coef)
        self.usage = None
        self.model_layers = self.hook.model_layers
        self._routed: list[list | None] | None = None  # the pass's micro-batches' samples' experts to replay

    @contextlib.contextmanager
    def routing_pass(self, routed: list[list | None] | None = None, count: bool = False, capture: bool = False,
                      aux_counts: bool = False, aux: tuple | None = None, aux_logits: bool = False):
        """Around one pipeline pass. `routed[k]`: the experts to replay for each sample of micro-batch k
        (Tensor[<= T_i - 1, L, K] or None each), or None; `count`: the usage metrics of a training
        pass; `capture`: keep what the routers chose (the yielded pass's `captured`: {(k, model
        layer): chosen, in megatron's (position, sample) order}); `aux_counts`: count each micro-batch's
        routed slots over this stage's layers (the pass's `aux_counts`, for `pipeline_aux`); `aux`:
        attach each layer's share of the load-balancing loss (`pipeline_aux`'s result); `aux_logits`:
        keep the router logits with their graph and the routed slots (TP: `local_aux_term`)."""
        state = _PipelinePass()
        if not self.enabled:
            yield state
            return
        usage = torch.zeros(self.model_layers, self.hook.num_experts) if count else None
        self._routed = routed
        self.hook._usage, self.hook._aux = usage, aux
        self.hook._captured = state.captured if capture else None
        self.hook._aux_counts = state.aux_counts if aux_counts or aux_logits else None
        self.hook._aux_logits = state.aux_logits if aux_logits else None
        try:
            yield state
        finally:
            self._routed = None
            self.hook._usage = self.hook._real = self.hook._replay = self.hook._captured = None
            self.hook._k = self.hook._aux_counts = self.hook._aux = self.hook._aux_logits = None
        if usage is not None:
            self.usage = usage if self.usage is None else self.usage + usage

    def pipeline_aux(self, state: "_PipelinePass", batches: list, scale: float, group) -> tuple | None:
        """The load-balancing loss of a pipeline training pass, per micro-batch k (the HF formula over
        its real tokens and every MoE layer, as `training_forward` without pipeline parallelism):
        `E * sum_e f_e P_e` = `E / (L T)^2 * sum_e count_e * sum_(l, t) p_lte` with count_e the slots
        routed to e over all layers - known once every stage has run k (`state.aux_counts`, summed
        over the pipeline `group`) - and linear in each layer's probabilities. So each stage's
        routers add their layers' terms, attached to their outputs (`routing_pass(aux=...)`) in the
        forward of the training pass, which routes as the pass that counted. `scale` multiplies the
        coefficient (the backend's mean over micro-batches). Collective over `group`."""
        if not self.enabled or self.aux_coef == 0:
            return None
        n = len(batches)
        counts = torch.stack([state.aux_counts.get(k, torch.zeros(self.hook.num_experts)) for k in range(n)])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        tokens = torch.tensor([sum(len(t) for t in toks) for toks, _ in batches], dtype=torch.float64)
        return counts, tokens, self.aux_coef * scale

    def before_forward(self, k: int, lens: list[int], shape: tuple[int, int], filler: bool) -> None:
        """Micro-batch k's forward is next: `lens` of its samples in a right-padded [b, t] batch (none
        for a filler micro-batch)."""
        b, t = shape
        lo, hi = self._positions(t)
        real = torch.zeros(b, t, dtype=torch.bool)
        if not filler:
            for i, n in enumerate(lens):
                real[i, :n] = True
        self.hook._real = real.t()[lo:hi].reshape(-1)  # megatron's routers see (position, sample)
        self.hook._k = k
        self.hook._replay = None
        routed = self._routed[k] if self._routed is not None and not filler and k < len(self._routed) else None
        if routed is not None and any(r is not None for r in routed):
            rows = replay_rows(routed, lens, False, t, self.model_layers, self.hook.top_k)
            pad = torch.full((b * t - rows.shape[0], self.model_layers, self.hook.top_k), -1, dtype=torch.int32)
            rows = torch.cat([rows, pad]).reshape(b, t, self.model_layers, -1)[:, lo:hi]
            self.hook._replay = rows.reshape(b * (hi - lo), self.model_layers, -1)

    def _positions(self, t: int) -> tuple[int, int]:
        """The positions of a [b, t] batch this rank's routers see (all but under sequence parallelism)."""
        size = t // self.hook.sp_size
        return self.hook.sp_rank * size, (self.hook.sp_rank + 1) * size

    def local_aux_term(self, state: "_PipelinePass", k: int, tokens: int, scale: float, group) -> Tensor:
        """The load-balancing loss of micro-batch k (`tokens` real tokens) restricted to the tokens this
        rank's routers saw (their logits' graph in `state.aux_logits`), with the routed-slot counts of
        every rank of `group` (summed over it: the HF formula is linear in the probabilities once the
        counts are known, see `pipeline_aux`); the group's terms add up to the loss. Collective."""
        counts = state.aux_counts.get(k, torch.zeros(self.hook.num_experts)).clone()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        n = self.model_layers * float(tokens)
        total = None
        for (kk, _), (logits, real) in sorted(state.aux_logits.items(), key=lambda x: x[0]):
            if kk != k:
                continue
            probs = torch.softmax(logits.float(), dim=-1)[real.to(logits.device)]
            term = (probs.sum(dim=0) * counts.to(probs.device)).sum()
            total = term if total is None else total + term
        if total is None:
            return torch.zeros((), requires_grad=False)
        return self.aux_coef * scale * self.hook.num_experts / (n * n) * total

    def joined_recording(self, state: _PipelinePass, k: int, shape: tuple[int, int], own: tuple[int, int],
                           width: int, group) -> Recording:
        """What every layer's router chose for micro-batch k of a pass (`state`), as a Recording of
        this rank's samples `own` = [s, e) of the micro-batch padded to `width` tokens, in slime's
        (sample, position) order; the pipeline stages' layers, or the TP ranks' parts of the sequence,
        joined over `group`. Collective."""
        b, t = shape
        lo, hi = self._positions(t)
        full = torch.full((t, b, self.model_layers, self.hook.top_k), -1, dtype=torch.int32)
        for (kk, layer), chosen in state.captured.items():
            if kk == k:
                full[lo:hi, :, layer] = chosen.cpu().reshape(hi - lo, b, -1)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(full, op=dist.ReduceOp.MAX, group=group)
        s, e = own
        mine = full.transpose(0, 1)[s:e, :width].reshape((e - s) * width, self.model_layers, -1)
        rec = Recording()
        for layer in range(self.model_layers):
            rec._add(layer, mine[:, layer].contiguous(), torch.empty(0))
        return rec


# ------------------------------------------------------------------ the backend's MoE steps

GPU_ONLY_FLAGS = (("moe_grouped_gemm", "--moe-grouped-gemm"), ("moe_permute_fusion", "--moe-permute-fusion"),
                  ("moe_enable_deepep", "--moe-enable-deepep"))


def check_moe_args(args, config, tp: int, pp: int, ep: int, etp: int, world_size: int) -> None:
    """The megatron backend's MoE start-up checks (one line each)."""
    check_moe_config(config, tp, pp, ep, etp)
    if world_size % ep:
        raise SlimeConfigError(f"--expert-model-parallel-size {ep} must divide the {world_size} train ranks")
    for attr, flag in GPU_ONLY_FLAGS:
        if getattr(args, attr, False):
            raise SlimeConfigError(f"{flag} needs GPU kernels; slime's megatron MoE layers run SequentialMLP "
                                   "experts with the all-to-all / all-gather dispatcher")
    if getattr(args, "moe_token_dispatcher_type", None) == "flex":
        raise SlimeConfigError("--moe-token-dispatcher-type flex needs DeepEP / GPU kernels; use alltoall or "
                               "allgather")


@contextlib.contextmanager
def policy_routing(backend, model, mb):
    """Around a forward of `mb`: the policy's routing replayed / recorded (`backend.last_routing`)."""
    if model is not backend.model or not backend.routing.enabled or not mb.tokens:
        yield None
        return
    with backend.routing.forward(mb.routed_experts, *routing_layout(mb)) as backend.last_routing:
        yield backend.last_routing


def routed_tp_forward(backend, mb, tokens, lengths, s: int, e: int, *, with_entropy: bool, entropy_grad: bool,
                      count: bool = False, aux_scale: float | None = None):
    """The policy's forward of the TP group's micro-batch `tokens` (this rank's samples [s, e)) under
    TP + sequence parallelism, where each TP rank's routers see their part of the sequence: the
    group's experts replayed (R2/R3), the routing recorded (`backend.last_routing`, this rank's
    samples, R2), with `count` the usage metrics, with `aux_scale` the load-balancing loss term of
    this rank's tokens (else None). (per-sample log-probs, entropies, aux term). Collective over TP."""
    routing, group = backend.routing, backend.tp_group
    routed = [group_routed(mb, group)]
    m = backend.seq_multiple
    shape = (len(tokens), -(-max(len(t) for t in tokens) // m) * m)
    with routing.routing_pass(routed, count=count, capture=True, aux_logits=aux_scale is not None) as rp:
        routing.before_forward(0, [len(t) for t in tokens], shape, False)
        lps, ents = backend._forward(backend.model, tokens, lengths, with_entropy=with_entropy,
                                     entropy_grad=entropy_grad)
    width = max((len(t) for t in mb.tokens), default=0)
    backend.last_routing = routing.joined_recording(rp, 0, shape, (s, e), width, group)
    aux = routing.local_aux_term(rp, 0, sum(len(t) for t in tokens), aux_scale, group) \
        if aux_scale is not None else None
    return lps, ents, aux


def group_routed(mb, group) -> list | None:
    """The experts to replay (R2/R3) for every sample of the group's micro-batch (the ranks'
    micro-batches in group-rank order, as the backend joins them), or None when no sample has any.
    Collective over the group."""
    mine = list(mb.routed_experts) if mb.routed_experts is not None else [None] * len(mb.tokens)
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    flat = [r for part in parts for r in part]
    return flat if any(r is not None for r in flat) else None


def routing_layout(mb) -> tuple[list[int], bool, int]:
    """How megatron's routers see a micro-batch (slime's order): right-padded rows of the longest sample."""
    lens = [len(t) for t in mb.tokens]
    return lens, False, max(lens) if lens else 0


def idle_forward(model, device, backward: bool, seq_len: int = 1) -> None:
    """A rank with no samples under expert parallelism still joins the token dispatch (all-to-all)
    of the other EP ranks' forward (and backward): `seq_len` tokens (the TP size under sequence
    parallelism, which splits them over the TP group), output unused (zero gradient)."""
    ids = torch.zeros((1, seq_len), dtype=torch.long, device=device)
    pos = torch.arange(seq_len, device=device).unsqueeze(0)
    with torch.set_grad_enabled(backward), shims.cpu_only_cuda_shims():
        out = model(ids, pos, attention_mask=shims.causal_mask(seq_len, device))
        if backward:
            (out.sum() * 0.0).backward()
