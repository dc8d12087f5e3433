"""The PPO critic of the megatron backend (`MegatronBackend(value_head=True)`): the policy's
GPTModel backbone with, on the last pipeline stage, a value head in place of the vocabulary
output layer.

The head is a replicated (not TP-split) Linear(hidden, 1) called like megatron's output layer
(`output_layer(hidden, weight=, runtime_gather_output=)` -> `(out, None)`), so the GPTModel's
forward returns values [b, s, 1]. Every TP rank computes the same values from the same hidden
states: under plain TP the final norm's output is already whole on every rank; under sequence
parallelism it is gathered over the TP group first, and the backward takes back this rank's
slice only (the upstream gradient is the same on every rank, so nothing is summed). The head's
gradient is therefore identical on every TP rank, and the gradient norm counts it once (no
`tensor_model_parallel` attribute: `param_is_not_tensor_parallel_duplicate` is true on TP rank 0
only).

Weights: exactly the FSDP critic's. The checkpoint is loaded with
`AutoModelForTokenClassification.from_pretrained(num_labels=1)` (transformers initializes `score`
from the torch RNG, seeded by the train actor as for FSDP); `score.weight` / `score.bias` become
the head's `output_layer.weight` / `output_layer.bias`, and the backbone converts like the
policy's except that there is no `lm_head` (the conversion runs on a copy of the config marked
tied, which neither expects nor writes one). Exported names are HF token-classification ones
(`model.*`, `score.weight`, `score.bias`), as FSDP's critic writes them.
"""

from __future__ import annotations

import copy

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from torch import Tensor
from transformers import AutoModelForTokenClassification

from slime.training.megatron import convert as mc
from slime.training.megatron import moe
from slime.training.megatron.weights import load_mcore_into, to_hf
from slime.utils.errors import SlimeConfigError

HEAD = "output_layer."  # the value head's megatron names: output_layer.weight, output_layer.bias
SCORE = "score."  # HF token-classification names


class ValueHead(torch.nn.Linear):
    """Linear(hidden, 1) with the call signature of GPTModel's output layer."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, bias: bool = True):
        super().__init__(hidden_size, 1, bias=bias)
        self.sequence_parallel = sequence_parallel  # GPTModel reads it (inference paths)

    def forward(self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, h]; backward: this rank's slice
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=ps.get_tensor_model_parallel_group())
        return super().forward(hidden), None


def check_critic(config) -> None:
    if moe.is_moe(config):
        raise SlimeConfigError("--advantage-estimator ppo with --train-backend megatron: the critic of a "
                               "mixture-of-experts model is not supported yet (use --train-backend fsdp)")


def hf_state(path: str) -> tuple[object, dict[str, Tensor]]:
    """(config, state dict) of the token-classification model the FSDP critic starts from; `score`
    is initialized by transformers from the torch RNG (the caller's seed state)."""
    try:
        model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    except ValueError as e:
        raise SlimeConfigError(f"the PPO critic needs a token-classification head for this model type in "
                               f"transformers: {e}") from e
    return model.config, {k: v.detach() for k, v in model.state_dict().items()}


def build_config(config):
    """The config the critic's GPTModel is built from: an output layer of its own (replaced by the
    head), no embedding shared with it."""
    out = copy.deepcopy(config)
    out.tie_word_embeddings = False
    return out


def _convert_config(config):
    """The config the backbone converts with: marked tied, so no lm_head is expected or written."""
    out = copy.deepcopy(config)
    out.tie_word_embeddings = True
    return out


def attach_value_head(model, hf_config, sequence_parallel: bool, bias: bool = True) -> None:
    """Replace the last stage's vocabulary output layer by the value head (fp32, like the model)."""
    if model.post_process:
        model.output_layer = ValueHead(hf_config.hidden_size, sequence_parallel, bias=bias).to(torch.float32)


def load_into(model, state: dict[str, Tensor], config, tp: int, tp_rank: int) -> None:
    """Copy the token-classification state dict into this TP rank's critic chunk."""
    state = dict(state)
    head = {HEAD + k[len(SCORE):]: state.pop(k) for k in list(state) if k.startswith(SCORE)}
    full = mc.hf_to_mcore(state, _convert_config(config), vocab_rows=model.vocab_size)
    full.update(head)
    load_mcore_into(model, full, tp, tp_rank)


def export(mcore_state: dict[str, Tensor], config) -> dict[str, Tensor]:
    """Full megatron state of the critic -> HF token-classification state."""
    state = dict(mcore_state)
    head = {SCORE + k[len(HEAD):]: state.pop(k) for k in list(state) if k.startswith(HEAD)}
    out = to_hf(state, _convert_config(config))
    out.update(head)
    return out


def response_values(out: Tensor, ids: Tensor, prompt_lens: list[int], lengths: list[int], *,
                    with_entropy: bool = False, entropy_grad: bool = False) -> tuple[list[Tensor], list[None]]:
    """Per-sample values of the response tokens (lists of Tensor[r_i], fp32): response token t's
    value is the head's output at position t - 1, aligned with the log-probs (`pipeline.response_scores`'s
    signature; no entropy)."""
    values = []
    for i, (p, r) in enumerate(zip(prompt_lens, lengths)):
        v = out[i, p - 1 : p - 1 + r, 0].float()
        if r == 0 and torch.is_grad_enabled():
            v = v + 0.0 * out[i].sum()  # keep the graph (and its TP collectives) connected
        values.append(v)
    return values, [None] * len(values)
