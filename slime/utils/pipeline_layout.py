"""How a model's decoder layers split over megatron's pipeline stages (--pipeline-model-parallel-size,
virtual stages, uneven first / last stages): checked at parse time against the checkpoint's layer
count and turned into megatron-core TransformerConfig fields by the megatron backend."""

from __future__ import annotations

import dataclasses

import torch

from slime.utils.errors import SlimeConfigError


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """How the decoder layers split over pipeline stages: `pp` stages of `vp` model chunks each
    (virtual stages, megatron's interleaved schedule), with optional uneven first / last stages
    (--decoder-first/last-pipeline-num-layers)."""

    pp: int = 1
    vp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @classmethod
    def from_args(cls, args, num_layers: int) -> "PipelineLayout":
        pp = args.pipeline_model_parallel_size
        vp = args.virtual_pipeline_model_parallel_size or 1
        if vp < 1:
            raise SlimeConfigError(f"--virtual-pipeline-model-parallel-size must be >= 1, got {vp}")
        per_stage = args.num_layers_per_virtual_pipeline_stage
        if per_stage:
            if args.virtual_pipeline_model_parallel_size:
                raise SlimeConfigError("give --num-layers-per-virtual-pipeline-stage or "
                                       "--virtual-pipeline-model-parallel-size, not both")
            if per_stage < 1 or num_layers % (pp * per_stage):
                raise SlimeConfigError(f"--num-layers-per-virtual-pipeline-stage {per_stage} x "
                                       f"--pipeline-model-parallel-size {pp} must divide the model's {num_layers} "
                                       "layers")
            vp = num_layers // (pp * per_stage)
        return cls(pp, vp, args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)

    def check(self, num_layers: int) -> None:
        """Refuse a split megatron cannot build, naming the flags and the model's layer count."""
        first, last = self.first_stage_layers or 0, self.last_stage_layers or 0
        middle_stages = self.pp - (first > 0) - (last > 0)
        rest = num_layers - first - last
        what = (f"the model's {num_layers} layers over --pipeline-model-parallel-size {self.pp}"
                + (f" x {self.vp} virtual stages" if self.vp > 1 else "")
                + (f" (first stage {first}, last stage {last} layers)" if first or last else ""))
        if rest < 0 or (middle_stages == 0 and rest) or (middle_stages and rest % (middle_stages * self.vp)):
            raise SlimeConfigError(f"cannot split {what}: the layers of the other stages must divide evenly")
        if middle_stages and rest // (middle_stages * self.vp) == 0:
            raise SlimeConfigError(f"cannot split {what}: a stage would have no layers")
        if self.vp > 1 and (first or last):
            raise SlimeConfigError("--decoder-first/last-pipeline-num-layers cannot be combined with virtual "
                                   "pipeline stages")

    def config_fields(self, dtype=torch.float32) -> dict:
        """megatron TransformerConfig fields of this layout (activations sent between stages in `dtype`)."""
        return dict(pipeline_model_parallel_size=self.pp,
                    virtual_pipeline_model_parallel_size=self.vp if self.vp > 1 else None,
                    num_layers_in_first_pipeline_stage=self.first_stage_layers,
                    num_layers_in_last_pipeline_stage=self.last_stage_layers,
                    microbatch_group_size_per_vp_stage=self.pp,
                    # every micro-batch of a step is padded to one [batch, sequence] shape, so the stages
                    # exchange activations of a fixed shape (megatron's variable_seq_lengths shape exchange
                    # hangs in its interleaved schedule over gloo)
                    pipeline_dtype=dtype, variable_seq_lengths=False,
                    # gloo: plain isend/irecv (a batched exchange needs NCCL); per-token sums, no division
                    batch_p2p_comm=torch.cuda.is_available(), calculate_per_token_loss=True)
