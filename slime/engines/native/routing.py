"""Routed experts of the native engine: SGLang's `return_routed_experts`, for rollout routing replay
(R3, `--use-rollout-routing-replay`) on mixture-of-experts models.

Request: `return_routed_experts: true` (top level; for a batch also a list, one per prompt; null or
false: off). Served whether or not the server was started with `--enable-return-routed-experts` (SGLang
needs that flag; the native engine accepts it and records nothing until a request asks). Refused (400)
for a model without MoE layers and on a streamed request.

Response (`meta_info`): `routed_experts`, the base64 of the int32 bytes (row-major) of an array
[len(prompt) + len(output) - 1, MoE layers, top-k]: the experts each token was routed to at each MoE
layer, one row for every token that went through a forward (the prompt's, and every output token but
the last, which no forward has seen); `routed_experts_start_len: 0`.

How: one `RoutingHook` (slime.utils.moe_routing) wraps the model's routers at start-up. A forward
records only when a request of its batch asks (`EngineRouting.record`), and the recorded rows go to
the requests that asked, each keeping its own (`Request.routed`, concatenated when it completes):
a prefill gives every request the rows of its prompt (left padding dropped; identical prompts
prefilled once share their rows), a decode step the row of each running request's last token. The
deterministic path's per-row forwards record the same way. The prompt-log-prob forward of
`logprob_start_len` adds no rows; a request that generates nothing (`max_new_tokens: 0`) gets its
prompt routed by a forward of its own; a request aborted before any forward saw it (while it
waited) has no `routed_experts` field. Rows live in the request only: nothing survives it, so a
weight update never mixes routings of old weights into a later request.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from slime.engines.protocol import ProtocolError
from slime.utils.moe_routing import Recording, RoutingHook, routers

if TYPE_CHECKING:
    from slime.engines.native.requests import Request

FIELD = "return_routed_experts"


def pop_routed_experts(body: Any) -> Any:
    """Remove `return_routed_experts` from a decoded `/generate` body (the rest goes to the parser);
    returns its raw value, read per prompt by `routed_experts_flags` once the prompts are known."""
    return body.pop(FIELD, None) if isinstance(body, dict) else None


def routed_experts_flags(value: Any, n: int, is_batch: bool) -> list[bool]:
    """One flag per prompt from `return_routed_experts`: a boolean (or null) for every prompt, or for a
    batch a list with one per prompt."""
    if value is None:
        return [False] * n
    if isinstance(value, bool):
        return [value] * n
    if isinstance(value, list) and is_batch:
        if len(value) != n:
            raise ProtocolError(FIELD, f"a list needs one value per prompt ({n}), got {len(value)}")
        for i, v in enumerate(value):
            if v is not None and not isinstance(v, bool):
                raise ProtocolError(f"{FIELD}[{i}]", f"must be a boolean, got {v!r}")
        return [bool(v) for v in value]
    raise ProtocolError(FIELD, f"must be a boolean{' or a list of them' if is_batch else ''}, got {value!r}")


class EngineRouting:
    """The engine's routing hook (None for a dense model) and the bookkeeping of recorded rows."""

    def __init__(self, model: nn.Module):
        self.hook = RoutingHook(model) if routers(model) else None

    def check(self, name: str = FIELD) -> None:
        """ProtocolError when the model has no MoE layers (nothing to return)."""
        if self.hook is None:
            raise ProtocolError(name, "the served model has no mixture-of-experts layers: there are no routed "
                                      "experts to return")

    @contextlib.contextmanager
    def record(self, reqs: list[Request]) -> Iterator[Recording | None]:
        """Record the forwards of this block when one of `reqs` asks for its routed experts."""
        if self.hook is None or not any(r.routed is not None for r in reqs):
            yield None
            return
        with self.hook.recording() as rec:
            yield rec

    def add_prefill(self, rec: Recording | None, reqs: list[Request], row_of: list[int],
                    prompts: list[list[int]], per_row: bool) -> None:
        """Give each request that asks the rows of its prompt from the prefill recorded in `rec`:
        one left-padded forward of all `prompts` (or, `per_row`, one forward per prompt)."""
        if rec is None:
            return
        if per_row:
            rows = [rec.indices(i).cpu() for i in range(len(prompts))]
        else:
            width = max(len(p) for p in prompts)
            idx = rec.indices().cpu()
            idx = idx.view(len(prompts), width, *idx.shape[1:])
            rows = [idx[i, width - len(p):] for i, p in enumerate(prompts)]
        for r, i in zip(reqs, row_of):
            if r.routed is not None:
                r.routed.append(rows[i])

    def add_decode(self, rec: Recording | None, reqs: list[Request]) -> None:
        """Give each request that asks the row of the token it fed to the decode step recorded in `rec`
        (one [B, 1] forward, or one [1, 1] forward per row)."""
        if rec is None:
            return
        idx = torch.cat([rec.indices(i) for i in range(len(rec.calls))]).cpu()
        for j, r in enumerate(reqs):
            if r.routed is not None:
                r.routed.append(idx[j:j + 1])

    @torch.inference_mode()
    def route_prompt(self, engine, r: Request) -> None:
        """The rows of a request that generates nothing: one forward of its prompt alone, all but its
        last token's row kept (len(prompt) + 0 - 1 rows, as SGLang returns)."""
        ids = torch.tensor([r.input_ids], dtype=torch.long, device=engine.device)
        with self.record([r]) as rec, engine._lora_rows([r.lora_name]):
            engine.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        if rec is not None:
            r.routed.append(rec.indices().cpu()[:-1])
