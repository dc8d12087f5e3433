"""Vision-language models (Qwen2-VL / Qwen2.5-VL) in the megatron backend: megatron-core's GPTModel
with multimodal rope for the language model, fed by the checkpoint's own Hugging Face vision tower.

- The language model is a Qwen2 decoder whose rope splits each head's rotary frequencies into
  (temporal, height, width) sections (`mrope_section`). `lm_config` is the checkpoint's text config
  as that Qwen2 causal LM (the conversion, TP sharding and checks of every other model apply), and
  `build_model(mrope_section=...)` gives the GPTModel megatron's MultimodalRotaryEmbedding, which
  computes the same rotation as Hugging Face's `apply_multimodal_rotary_pos_emb`.
- The vision tower is the HF module (`VisionTower.visual`, with the HF model's `get_rope_index`),
  attached to the model chunk as `vision`: its parameters are the chunk's, so they train (or stay
  frozen with `--freeze-params-name-list visual`), take part in --bf16's main copies, gradient
  reduction, clipping and checkpoints like the others, and are pushed under their HF names
  (`vision.visual.*` <-> `model.visual.*`). It is replicated on every TP rank, which runs it on the
  group's images: without sequence parallelism the gradient reaching the embedding output is whole
  on every TP rank (the first layer's column-parallel input sums it), so the tower's gradients are
  too; under sequence parallelism each rank's part of the sequence gives a part of them, which the
  TP group sums (their `sequence_parallel` mark, as for the layer norms).
- A forward with images: pixel inputs, image slots and 3-D positions as the FSDP trainer makes them
  (slime.training.vision), the tower's features put into the image slots of the embedding output
  (a forward hook on the GPTModel's embedding: [s, b, h], or this rank's part of s under SP).

Not built: pipeline parallelism (the images would have to reach the first stage through megatron's
schedules), a megatron critic for a VL model, a VL distillation teacher; each is refused at start-up.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel, Qwen2Config
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from slime.training.vision import IMAGE_MASK, has_images, padded_inputs
from slime.utils.errors import SlimeConfigError
from slime.utils.vision import VisionProcessor, load_lm

HF_PREFIX, LM_PREFIX, MCORE_PREFIX = "model.visual.", "model.language_model.", "vision.visual."


def lm_config(config: PretrainedConfig) -> tuple[Qwen2Config, list[int]]:
    """(the VL checkpoint's language model as a Qwen2 causal-LM config, its mrope_section)."""
    text = config.get_text_config(decoder=True)
    fields = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
    rope = dict(fields.pop("rope_parameters", None) or {})
    scaling = dict(fields.pop("rope_scaling", None) or {})
    section = rope.pop("mrope_section", None) or scaling.get("mrope_section")
    if not section:
        raise SlimeConfigError(f"{getattr(config, 'model_type', '?')}: the text config names no mrope_section")
    if rope.get("rope_type") == "mrope" or scaling.get("type") == "mrope":
        rope["rope_type"] = "default"  # older Qwen2-VL configs name the plain rope of each section so
    rope.setdefault("rope_theta", getattr(text, "rope_theta", 1000000.0))
    fields["rope_parameters"] = rope
    fields["tie_word_embeddings"] = bool(getattr(config, "tie_word_embeddings", False))
    return Qwen2Config(**fields), [int(s) for s in section]


def _tower_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The vision tower class of the VL model of `config` (e.g. Qwen2_5_VisionTransformerPretrainedModel)."""
    module = sys.modules[MODEL_MAPPING[type(config)].__module__]
    for cls in vars(module).values():
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel) \
                and getattr(cls, "config_class", None) is type(config.vision_config):
            return cls
    raise SlimeConfigError(f"{config.model_type}: no vision tower class for {type(config.vision_config).__name__}")


class VisionTower(torch.nn.Module):
    """The HF vision tower (`visual`) and the HF model's 3-D rope positions (`get_rope_index`, read
    from `config` alone) of a Qwen-VL checkpoint, without its language model."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        self._model_class = MODEL_MAPPING[type(config)]  # e.g. Qwen2_5_VLModel, whose methods read config
        self.visual = _tower_class(config)._from_config(config.vision_config)

    def get_rope_index(self, *args, **kwargs):
        return self._model_class.get_rope_index(self, *args, **kwargs)

    def get_vision_position_ids(self, *args, **kwargs):
        return self._model_class.get_vision_position_ids(self, *args, **kwargs)

    def features(self, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        """[image tokens, hidden] of the images in order, as the HF model's get_image_features."""
        dtype = next(self.visual.parameters()).dtype
        return self.visual(pixel_values.to(dtype), grid_thw=grid_thw).pooler_output


def hf_state(path: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the language model's state under causal-LM names, the vision tower's under `visual.*`-less
    names) of a VL checkpoint, fp32."""
    model = load_lm(path, dtype=torch.float32)
    lm, tower = {}, {}
    for k, v in model.state_dict().items():
        if k.startswith(HF_PREFIX):
            tower[k[len(HF_PREFIX):]] = v.detach()
        elif k.startswith(LM_PREFIX):
            lm["model." + k[len(LM_PREFIX):]] = v.detach()
        else:
            lm[k] = v.detach()
    return lm, tower


def attach(model, config: PretrainedConfig, tower_state: dict[str, Tensor], sequence_parallel: bool) -> None:
    """Give a GPTModel chunk the checkpoint's vision tower (`model.vision`, in the chunk's dtype) and
    the hook that puts image features into its embedding output."""
    tower = VisionTower(config).to(torch.float32)  # built in the config's dtype (bf16 for most checkpoints)
    missing, unexpected = tower.visual.load_state_dict(tower_state, strict=False)
    if missing or unexpected:
        raise SlimeConfigError(f"vision tower weights do not match {type(tower.visual).__name__} "
                               f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    tower.to(next(model.parameters()).dtype)
    if sequence_parallel:
        for p in tower.parameters():
            p.sequence_parallel = True  # each TP rank's part of the sequence: summed over TP (grads.py)
    model.vision = tower
    model.vision_inputs = None  # set by `image_forward` around a forward with images
    model.embedding.register_forward_hook(lambda embedding, args, out: _place_features(model, out))


def _place_features(model, out: Tensor) -> Tensor:
    """The embedding output [s, b, h] (under SP this TP rank's [s / tp, b, h]) with the image
    features of the forward's image slots in place of their token embeddings."""
    inputs = model.vision_inputs
    if inputs is None:
        return out
    feats, mask = model.vision.features(inputs["pixel_values"], inputs["image_grid_thw"]), inputs[IMAGE_MASK]
    placed = feats.new_zeros(*mask.shape, feats.shape[-1])  # [b, s, h]: row-major slots, the features' order
    placed[mask] = feats
    placed, mask = placed.transpose(0, 1), mask.t()  # [s, b, ...]
    if out.shape[0] != placed.shape[0]:  # sequence parallel: this rank's part of the sequence
        n, rank = out.shape[0], ps.get_tensor_model_parallel_rank()
        placed, mask = placed[rank * n: (rank + 1) * n], mask[rank * n: (rank + 1) * n]
    return torch.where(mask.unsqueeze(-1), placed.to(out.dtype), out)


def group_images(mb, tp_group) -> list:
    """The image sources of the TP group's samples, in the order of the group's gathered micro-batch
    (the backend's `_gather_tp`: TP rank by rank). Collective over the TP group."""
    images = list(mb.images) if mb.images is not None else [None] * len(mb.tokens)
    tp = dist.get_world_size(tp_group)
    if tp == 1:
        return images
    parts: list = [None] * tp
    dist.all_gather_object(parts, images, group=tp_group)
    return [i for p in parts for i in p]


@contextlib.contextmanager
def image_forward(model, processor: VisionProcessor, images: list | None, ids: Tensor, lengths: list[int]):
    """Around a forward of padded rows ids [b, t] (the samples' real lengths `lengths`): yields their
    position ids, [3, b, t] (text positions on all three axes where a row has no image), and makes
    the chunk's embedding put the rows' image features into their image slots."""
    b, t = ids.shape
    if not has_images(images):
        yield torch.arange(t, device=ids.device).view(1, 1, t).expand(3, b, t)
        return
    attn = (torch.arange(t, device=ids.device)[None, :] < torch.as_tensor(lengths, device=ids.device)[:, None])
    inputs = padded_inputs(model.vision, processor, images, ids, attn.long())
    model.vision_inputs = inputs
    try:
        yield inputs["position_ids"]
    finally:
        model.vision_inputs = None


def to_hf(mcore_full: dict[str, Tensor], lm_to_hf) -> dict[str, Tensor]:
    """Whole-model megatron state -> the VL checkpoint's HF names: the language model's through
    `lm_to_hf` (causal-LM names) moved under `model.language_model.`, the tower's under `model.visual.`."""
    lm = lm_to_hf({k: v for k, v in mcore_full.items() if not k.startswith("vision.")})
    out = {(LM_PREFIX + k[len("model."):] if k.startswith("model.") else k): v for k, v in lm.items()}
    out.update({HF_PREFIX + k[len(MCORE_PREFIX):]: v for k, v in mcore_full.items() if k.startswith(MCORE_PREFIX)})
    return out
