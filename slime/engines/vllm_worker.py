"""A vLLM worker extension that loads Hugging Face-named weights from safetensors files.

Runs INSIDE the vLLM virtual environment (the vLLM server is started with
`--worker-extension-cls slime.engines.vllm_worker.SlimeWorkerExtension` and slime's
repository on PYTHONPATH), so it imports nothing from slime and only torch /
safetensors, which vLLM itself depends on.

slime's vLLM adapter calls these methods through vLLM's dev-mode `POST /collective_rpc`
(`{"method": "slime_load_weights", "args": [path, ...]}`); every worker runs them and
returns a small JSON-able dict. Loading goes through vLLM's own in-place `reload_weights`,
which maps HF names onto vLLM's fused parameters (qkv_proj, gate_up_proj, ...) and re-runs
each layer's post-load processing.
"""

from __future__ import annotations

import glob
import os


class SlimeWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _slime_reload(self, files: list[str]) -> dict:
        """Reload the model from checkpoint-format (HF-named) tensors in `files`, in place.

        vLLM's `reload_weights` restores each layer's checkpoint layout, loads the tensors and
        re-runs the layer's post-load processing (CPU kernels repack their weights), which a
        bare `model.load_weights` on a served model cannot do. All tensors of one update go
        in one call: a layer processed with only part of its tensors (q but not k of a fused
        qkv) would be wrong.
        """
        from safetensors import safe_open

        count = {"n": 0}

        def tensors():
            for f in files:
                with safe_open(f, framework="pt", device="cpu") as sf:
                    for name in sf.keys():
                        count["n"] += 1
                        yield name, sf.get_tensor(name)

        runner = self.model_runner
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        else:  # older vLLM: plain load (fine where no post-load processing repacks weights)
            self.get_model().load_weights(weights=tensors())
        retied = self._slime_reprocess_tied_heads()
        return {"num_tensors": count["n"], "num_files": len(files), "retied": retied}

    def _slime_reprocess_tied_heads(self) -> int:
        """A head tied to the input embedding gets no tensor of its own (checkpoints and the
        trainer send the embedding once), so the reload leaves its post-load state alone; on
        CPU that state is a packed copy of the OLD weight (its GEMM kernel). Re-run the head's
        post-load processing over the (shared, now updated) weight."""
        import torch

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

    def slime_weight_sums(self, names_json: str = "[]") -> dict:
        """float64 sum of each named vLLM parameter (all when none are named), for tests and
        debugging: vLLM's parameter names, which differ from HF's for fused layers."""
        import json

        import torch

        wanted = set(json.loads(names_json))
        out = {}
        for name, p in self.get_model().named_parameters():
            if not wanted or name in wanted:
                out[name] = float(p.detach().to(torch.float64).sum())
        return out
