"""Every CPU-only shim slime applies to megatron-core (0.16), in one place.

megatron-core is written for CUDA. Its arithmetic runs on the CPU unchanged, but a few
bookkeeping spots name the CUDA device or the CUDA RNG directly and raise on a CPU-only
torch build. On a machine with CUDA none of these shims does anything.

1. `torch.cuda.current_device()` -> "cpu" and `torch.cuda.synchronize()` -> no-op, while
   `cpu_only_cuda_shims()` is active:
     * `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` on the
       first forward (models/common/embeddings/rotary_pos_embedding.py);
     * dist_checkpointing's torch_dist writer calls `torch.cuda.synchronize()`
       (FileSystemWriterAsync.preload_tensors) and puts its failure-flag tensor on
       `torch.cuda.current_device()` (save_state_dict_async_finalize).
   With no CUDA device there is nothing to synchronize and the tensors belong on the CPU,
   so those calls mean exactly that. Scoped: restored on exit.
   Under pipeline parallelism two more spots name CUDA, handled the same way in the same scope:
     * the pipeline schedules count tokens in `torch.zeros([], device="cuda")`
       (pipeline_parallel/schedules.py): `torch.zeros` with device "cuda" -> the CPU;
     * a tied output layer on the last stage is copied from the first stage's embedding with
       `weight.data.cuda()` then an all-reduce (LanguageModule.setup_embeddings_and_output_layer):
       `Tensor.cuda()` -> the tensor itself.
   Under sequence parallelism the tensor-parallel linear layers' backward allocates its
   all-gather buffer on `torch.cuda.current_device()`: the backward runs in the same scope.
2. The CUDA RNG tracker: attention dropout and the tensor-parallel layers enter
   `get_cuda_rng_tracker().fork()`, which saves and restores the CUDA RNG state.
   `use_cpu_rng_tracker()` initializes megatron's own inference tracker (a `fork` that is a
   null context, megatron's `initialize_rng_tracker(inference_rng_tracker=True)`). slime runs
   with dropout 0 and initializes no weights (all come from the HF checkpoint), so nothing
   draws random numbers under the fork. Process-wide (megatron keeps one tracker).
3. The attention mask: megatron's unfused softmax builds a default causal mask with
   `device="cuda"` (transformer/utils.py get_default_causal_mask) when it is given none.
   `causal_mask(s)` builds the same [1, 1, s, s] boolean mask (True = masked) on the CPU
   and the backend always passes it. Not a patch: an argument megatron accepts.

4. Without Transformer Engine, megatron-core's MoE router gating (transformer/moe/moe_utils.py
   RouterGatingLinearFunction) tests `te_general_gemm is not None`, a name the module defines only
   when Transformer Engine imports. `define_missing_te_gemm()` defines it as None (the torch
   matmul path megatron has for that case). Process-wide; a no-op when Transformer Engine is there.

5. megatron's all-to-all token dispatcher (expert parallelism) creates a CUDA stream for its
   device-to-host copies of the split sizes and moves them there (`_maybe_dtoh_and_synchronize`).
   On the CPU the tensors are already in host memory: `cpu_alltoall_dispatcher()` gives the class a
   placeholder stream and a `_maybe_dtoh_and_synchronize` that only turns the split sizes into the
   numpy arrays megatron's GPU path produces. Process-wide; a no-op when CUDA is available.

What is *not* used on the CPU: megatron's DistributedDataParallel and DistributedOptimizer
(they allocate contiguous grad buffers on `torch.cuda.current_device()` and overlap
communication on CUDA streams); slime reduces gradients itself (see backend.py).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def cpu_only_cuda_shims():
    """Shim 1 (see the module docstring). A no-op when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device, torch.zeros, torch.Tensor.cuda
    zeros = torch.zeros

    def zeros_on_cpu(*size, device=None, **kwargs):
        return zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)

    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"
    torch.zeros = zeros_on_cpu
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device, torch.zeros, torch.Tensor.cuda = saved


def use_cpu_rng_tracker() -> None:
    """Shim 2: megatron's inference RNG tracker (fork = null context) when there is no CUDA."""
    if torch.cuda.is_available():
        return
    # megatron-core is optional: slime.training.megatron.convert imports this module without it
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def causal_mask(seq_len: int, device):
    """Shim 3: megatron's causal attention mask ([1, 1, s, s], True = masked), built on `device`."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def define_missing_te_gemm() -> None:
    """Shim 4: megatron's MoE router gating names `te_general_gemm`; None selects its torch path."""
    # megatron-core is optional: slime.training.megatron.convert imports this module without it
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def cpu_alltoall_dispatcher() -> None:
    """Shim 5: megatron's all-to-all token dispatcher without CUDA streams (see the module docstring)."""
    if torch.cuda.is_available():
        return
    # megatron-core is optional: slime.training.megatron.convert imports this module without it
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def host_values(self, point: str, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name, None)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"  # never used as a stream on the CPU
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_values
