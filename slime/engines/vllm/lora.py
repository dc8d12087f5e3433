"""LoRA adapters behind the vLLM adapter, served the way SGLang names it.

`/load_lora_adapter {"lora_name", "lora_path"}` and `/unload_lora_adapter {"lora_name"}` go to
vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM runs with `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`) and are answered in SGLang's shape
`{success, error_message, loaded_adapters: {name: path}}`; as in SGLang, a name already loaded is
refused. `/generate`'s `lora_path` (an adapter's name; one per prompt of a batch; None: the base)
becomes the completions request's `model`, which is how vLLM selects an adapter.

vLLM's unload only forgets the name: requests already running keep the adapter, and vLLM loads
it again from its path for them when it is out of its slots. So, as in SGLang, an unload refuses
new requests for the adapter at once and reaches vLLM only after the running ones have ended:
once it answers, the trainer may rewrite the directory or load a new version under that name.

The route handlers take the adapter's state (`adapter.AdapterState`) as their first argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from aiohttp import web

from slime.engines.auth import check_request
from slime.engines.protocol import GenerateInput, ProtocolError, parse_load_lora_adapter, parse_unload_lora_adapter
from slime.engines.serving import read_json
from slime.engines.vllm.errors import HTTPFailure


class LoraAdapters(dict):
    """The adapters loaded into vLLM (name -> path), and the requests running on each."""

    def __init__(self):
        super().__init__()
        self.lock = asyncio.Lock()  # one load or unload at a time
        self.running: dict[str, int] = {}  # requests running per adapter name
        self.idle = asyncio.Condition()  # notified when requests end

    def check_names(self, inputs: list[GenerateInput], per_prompt: bool) -> None:
        """Every adapter named in `lora_path` is loaded (`per_prompt`: it was a list, one per prompt)."""
        for k, inp in enumerate(inputs):
            if inp.lora_name is not None and inp.lora_name not in self:
                field = f"lora_path[{k}]" if per_prompt else "lora_path"
                raise ProtocolError(field, f"no LoRA adapter named {inp.lora_name!r} is loaded "
                                           f"(loaded: {_listed(self)}); load it with /load_lora_adapter")

    @contextlib.asynccontextmanager
    async def using(self, names: list[str]):
        """Count the requests running on each adapter (an unload waits for its adapter's to end)."""
        for n in names:
            self.running[n] = self.running.get(n, 0) + 1
        try:
            yield
        finally:
            async with self.idle:
                for n in names:
                    self.running[n] -= 1
                    if not self.running[n]:
                        del self.running[n]
                self.idle.notify_all()

    def answer(self) -> web.Response:
        """SGLang's LoRAUpdateOutput."""
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self)})


def _listed(adapters: dict) -> str:
    return ", ".join(sorted(adapters)) or "none"


def _require_lora(state) -> None:
    if not state.lora:
        raise HTTPFailure(400, "LoRA is not enabled: this vLLM engine runs without --enable-lora (slime adds it "
                               "with --lora-rank and --lora-sync adapter; or give --vllm-enable-lora)")


async def load_lora_adapter(state, request: web.Request) -> web.Response:
    """vLLM's /v1/load_lora_adapter; a name already loaded is refused (SGLang does so; vLLM would
    reload it in place only with load_inplace, keeping prefix-cache blocks of the old weights)."""
    name, path, _pinned = parse_load_lora_adapter(await read_json(request))  # pinned: vLLM has no pinning
    _require_lora(state)
    check_request(request, weight_path=path)
    if not os.path.isdir(path):
        raise ProtocolError("lora_path", f"{path} is not a directory (a peft adapter directory)")
    adapters: LoraAdapters = state.lora_adapters
    async with adapters.lock:
        if name in adapters:
            raise ProtocolError("lora_name", f"a LoRA adapter named {name!r} is already loaded "
                                             f"({adapters[name]}); unload it first or use another name")
        try:
            await state.call("POST", "/v1/load_lora_adapter", as_text=True,
                             json_body={"lora_name": name, "lora_path": os.path.abspath(path)})
        except HTTPFailure as e:
            if e.status == 503:  # vLLM did not answer
                raise
            # vLLM's 404 (no adapter there) or 500 (its engine refused the adapter) is this request's fault
            raise HTTPFailure(400, f"could not load LoRA adapter {name!r} from {path}: {e.message}",
                              "lora_path") from None
        adapters[name] = path
    return adapters.answer()


async def unload_lora_adapter(state, request: web.Request) -> web.Response:
    """New requests for the adapter are refused at once, the running ones end, then vLLM's
    /v1/unload_lora_adapter."""
    name = parse_unload_lora_adapter(await read_json(request))
    _require_lora(state)
    adapters: LoraAdapters = state.lora_adapters
    async with adapters.lock:
        if name not in adapters:
            raise ProtocolError("lora_name", f"no LoRA adapter named {name!r} is loaded (loaded: {_listed(adapters)})")
        path = adapters.pop(name)
        try:
            async with adapters.idle:
                await adapters.idle.wait_for(lambda: not adapters.running.get(name))
            await state.call("POST", "/v1/unload_lora_adapter", as_text=True, json_body={"lora_name": name})
        except BaseException:
            adapters[name] = path
            raise
    return adapters.answer()
