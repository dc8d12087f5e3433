"""A vLLM worker extension that loads Hugging Face-named weights from safetensors files.

Runs INSIDE the vLLM virtual environment (the vLLM server is started with
`--worker-extension-cls slime.engines.vllm.worker.SlimeWorkerExtension` and slime's
repository on PYTHONPATH), so it imports only torch / safetensors, which vLLM itself
depends on, and slime's torch-only `slime.engines.native.weight_group`.

slime's vLLM adapter calls these methods through vLLM's dev-mode `POST /collective_rpc`
(`{"method": "slime_load_weights", "args": [path, ...]}`); every worker runs them and
returns a small JSON-able dict. Loading goes through vLLM's own in-place `reload_weights`,
which maps HF names onto vLLM's fused parameters (qkv_proj, gate_up_proj, ...) and re-runs
each layer's post-load processing.

Weights also arrive over a process group with the trainer (SGLang's
`/init_weights_update_group` + `/update_weights_from_distributed` protocol): each worker
joins as `rank_offset` + its tensor-parallel rank, receives every broadcast bucket, and
loads what it holds when the last bucket (`load=True`) has arrived.

Importing this module (vLLM does so in every worker process) also fixes LoRA serving on vLLM's
CPU platform: see `fix_cpu_lora_base_rows`.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from slime.engines.native.weight_group import destroy_group, new_group
from slime.utils.dist import BIND_ADDRESS_ENV


class SlimeWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _slime_reload(self, files: list[str]) -> dict:
        """Reload the model from the checkpoint-format (HF-named) tensors in `files`, in place."""

        def tensors():
            for f in files:
                with safe_open(f, framework="pt", device="cpu") as sf:
                    for name in sf.keys():
                        yield name, sf.get_tensor(name)

        return dict(self._slime_load(tensors()), num_files=len(files))

    def _slime_load(self, named_tensors) -> dict:
        """Load (HF name, tensor) pairs into the served model, in place.

        vLLM's `reload_weights` restores each layer's checkpoint layout, loads the tensors and
        re-runs the layer's post-load processing (CPU kernels repack their weights), which a
        bare `model.load_weights` on a served model cannot do. All tensors of one update go
        in one call: a layer processed with only part of its tensors (q but not k of a fused
        qkv) would be wrong.
        """
        count = {"n": 0}

        def counted():
            for name, t in named_tensors:
                count["n"] += 1
                yield name, t

        runner = self.model_runner
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        else:  # older vLLM: plain load (fine where no post-load processing repacks weights)
            self.get_model().load_weights(weights=counted())
        retied = self._slime_reprocess_tied_heads()
        return {"num_tensors": count["n"], "retied": retied, "moe_repacked": self._slime_repack_cpu_experts()}

    def _slime_repack_cpu_experts(self) -> int:
        """vLLM 0.32's unquantized MoE method sets its experts up once: on a weight update
        (`_setup_kernel` with a kernel already built) it copies the reloaded weights in but skips
        the experts' own post-load step, which on CPU prepacks them into the grouped-GEMM layout
        the kernel reads, so a reloaded MoE layer would compute with unpacked weights (even
        reloading the same checkpoint moved log-probs by 0.07). Run that step for every CPU MoE
        layer after a reload, as the first load did. Returns the number of layers repacked."""
        n = 0
        for _, m in self.get_model().named_modules():
            kernel = getattr(getattr(m, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if type(experts).__name__ == "CPUUnquantizedExperts":
                experts.process_weights_after_loading(m)
                n += 1
        return n

    def _slime_reprocess_tied_heads(self) -> int:
        """A head tied to the input embedding gets no tensor of its own (checkpoints and the
        trainer send the embedding once), so the reload leaves its post-load state alone; on
        CPU that state is a packed copy of the OLD weight (its GEMM kernel). Re-run the head's
        post-load processing over the (shared, now updated) weight."""
        model = self.get_model()
        embed_ptrs = {m.weight.data_ptr() for name, m in model.named_modules()
                      if name.endswith("embed_tokens") and isinstance(getattr(m, "weight", None), torch.Tensor)}
        n = 0
        for name, m in model.named_modules():
            w = getattr(m, "weight", None)
            qm = getattr(m, "quant_method", None)
            if (name.endswith("lm_head") and isinstance(w, torch.Tensor) and w.numel() > 0
                    and w.data_ptr() in embed_ptrs and hasattr(qm, "process_weights_after_loading")):
                qm.process_weights_after_loading(m)
                n += 1
        return n

    def slime_load_weights(self, *paths: str) -> dict:
        """Load every tensor of the given safetensors files (HF names) into the served model."""
        return self._slime_reload(list(paths))

    def slime_load_weights_from_dir(self, model_dir: str) -> dict:
        """Load every `*.safetensors` file of a Hugging Face model directory."""
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        return self._slime_reload(files)

    # ---- weights over a process group with the trainer (rank 0)
    def _slime_groups(self) -> dict:
        if not hasattr(self, "_slime_weight_groups"):
            self._slime_weight_groups = {}  # group name -> (process group, store, backend)
            self._slime_received = []  # (name, tensor) of the buckets of an update not loaded yet
        return self._slime_weight_groups

    def slime_init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "gloo") -> dict:
        """Join the trainer's weight group as rank `rank_offset` + this worker's tensor-parallel
        rank; blocks until every rank has joined."""
        groups = self._slime_groups()
        if group_name in groups:
            raise ValueError(f"a weight update group named {group_name!r} already exists")
        rank = int(rank_offset) + int(getattr(self, "rank", 0) or 0)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        pg, store = new_group(master_address, int(master_port), rank, int(world_size), group_name, backend,
                              device=device, bind_address=os.environ.get(BIND_ADDRESS_ENV))
        groups[group_name] = (pg, store, backend)
        self._slime_received = []
        return {"rank": rank}

    def slime_receive_weights(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                              load: bool) -> dict:
        """Receive one bucket (one broadcast per name from rank 0); with `load`, load it and the
        buckets received before it into the model."""
        groups = self._slime_groups()
        if group_name not in groups:
            raise ValueError(f"no weight update group named {group_name!r}")
        pg, _, backend = groups[group_name]
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
            pg.broadcast(t, 0).wait()
            self._slime_received.append((name, t))
        if not load:
            return {"num_tensors": len(names), "received": len(self._slime_received)}
        received, self._slime_received = self._slime_received, []
        return self._slime_load(iter(received))

    def slime_destroy_weights_update_group(self, group_name: str) -> dict:
        entry = self._slime_groups().pop(group_name, None)
        if entry is not None:
            destroy_group(entry[0])
            self._slime_received = []
        return {"destroyed": entry is not None}

    def slime_weight_sums(self, names_json: str = "[]") -> dict:
        """float64 sum of each named vLLM parameter (all when none are named), for tests and
        debugging: vLLM's parameter names, which differ from HF's for fused layers."""
        wanted = set(json.loads(names_json))
        out = {}
        for name, p in self.get_model().named_parameters():
            if not wanted or name in wanted:
                out[name] = float(p.detach().to(torch.float64).sum())
        return out


def _skip_base_rows(fn):
    """`fn`, one of vLLM's torch LoRA ops `bgmv_*(inputs, weights, output, indices, ...)`, with the
    rows of index -1 (no adapter: a base-model token) adding nothing, as vLLM's Triton kernels do."""
    if getattr(fn, "_slime_skips_base_rows", False):
        return fn

    def op(inputs, lora_weights, output_tensor, lora_indices_tensor, *args, **kwargs):
        base = lora_indices_tensor < 0
        if base.ndim == 1 and base.shape[0] == inputs.shape[0] and bool(base.any()):
            inputs = inputs.masked_fill(base.view(-1, *([1] * (inputs.ndim - 1))), 0)  # a zero delta
            lora_indices_tensor = lora_indices_tensor.clamp(min=0)
        return fn(inputs, lora_weights, output_tensor, lora_indices_tensor, *args, **kwargs)

    op._slime_skips_base_rows = True
    op.__wrapped__ = fn
    op.__name__ = getattr(fn, "__name__", "op")
    return op


def fix_cpu_lora_base_rows() -> bool:
    """vLLM's CPU LoRA ops (`vllm.lora.ops.torch_ops`, used by `PunicaWrapperCPU`) gather the
    adapter of each token as `weights[index]`, and index -1 (a base-model request) picks the LAST
    adapter slot: a base request batched with a LoRA request silently gets the adapter's delta
    (with --max-loras 1 always; vllm-project/vllm PR 48421, open). Wrap the ops so that those rows
    add nothing. True when the ops were found (and are now wrapped)."""
    try:  # vLLM: only inside its own venv (the engine's worker processes)
        from vllm.lora.ops.torch_ops import lora_ops  # vLLM's CPU LoRA ops
        from vllm.lora.punica_wrapper import punica_cpu  # their user on the CPU platform
    except Exception:  # noqa: BLE001 - no vLLM here, or another layout: nothing to fix
        return False
    names = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
    if not all(hasattr(lora_ops, n) for n in names):
        return False
    for n in names:
        fixed = _skip_base_rows(getattr(lora_ops, n))
        setattr(lora_ops, n, fixed)  # what lora_ops.sgmv_* (prefill) call
        if hasattr(punica_cpu, n):
            setattr(punica_cpu, n, fixed)  # PunicaWrapperCPU's decode path imported them by name
    return True


fix_cpu_lora_base_rows()
