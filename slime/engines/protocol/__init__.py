"""The HTTP protocol slime speaks to inference engines: SGLang's native API.

Pure functions (no torch, no aiohttp): request validation and response building for
`POST /generate` and the control endpoints. The embedded native engine uses them on
the server side; rollout code builds payloads of this shape and can send them to a
real SGLang server, the native engine or a router in front of either.

`POST /generate` body::

    {"input_ids": [int, ...]  |  "text": str,
     "sampling_params": {temperature, top_p, top_k, max_new_tokens, stop,
                         stop_token_ids, ignore_eos, skip_special_tokens, seed,
                         no_stop_trim},
     "return_logprob": bool, "rid": str | None,
     "logprob_start_len": int, "top_logprobs_num": int,    (with return_logprob; see `logprobs`)
     "lora_path": str | [str | None, ...] | None}   (the name of a loaded LoRA adapter)

Response::

    {"text": str, "output_ids": [int, ...],
     "meta_info": {"id": rid,
                   "finish_reason": {"type": "stop" | "length" | "abort",
                                     "matched": int | str | None, ["length": n]},
                   "prompt_tokens": int, "completion_tokens": int,
                   ["output_token_logprobs": [[logprob, token_id, None], ...],
                    "input_token_logprobs": [[logprob | None, token_id, None], ...],
                    ("input_top_logprobs", "output_top_logprobs" with top_logprobs_num)],
                   "weight_version": str}}

Log-prob definition: log-prob of the sampled token under
`log_softmax(logits / T)` with `T = temperature if temperature > 0 else 1.0`,
computed in fp32 before any top-k / top-p truncation.

Validation errors raise `ProtocolError(field, message)`; servers answer them with
HTTP 400 and `error_body(err)`.

`generate` holds the `/generate` request and response, `sampling` the sampling parameters,
`logprobs` the prompt and top log-prob options and their response entries,
`control_bodies` the control routes' bodies and `errors` the error type; every public name is
re-exported here: import from `slime.engines.protocol`. The routes' paths are in
`slime.engines.control.Route`.
"""

from __future__ import annotations

from slime.engines.protocol.control_bodies import (
    MEMORY_TAGS,
    WEIGHT_DTYPES,
    parse_abort_request,
    parse_bool_param,
    parse_destroy_weights_update_group,
    parse_init_weights_update_group,
    parse_load_lora_adapter,
    parse_memory_tags,
    parse_unload_lora_adapter,
    parse_update_weight_version,
    parse_update_weights_from_disk,
    parse_update_weights_from_distributed,
    parse_weight_version,
)
from slime.engines.protocol.errors import ProtocolError, error_body, is_int, is_number
from slime.engines.protocol.generate import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    MAX_JSON_DEPTH,
    GenerateInput,
    build_generate_response,
    check_prompt,
    check_prompt_count,
    check_prompt_length,
    finish_abort,
    finish_length,
    finish_stop,
    json_depth,
    parse_generate_request,
    parse_json_body,
)
from slime.engines.protocol.logprobs import (
    MAX_TOP_LOGPROBS_NUM,
    check_logprob_start,
    logprob_meta,
    logprob_start,
    scores_prompt,
    token_triples,
    top_triples,
)
from slime.engines.protocol.sampling import (
    DEFAULT_MAX_NEW_TOKENS,
    SamplingParams,
    parse_sampling_params,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "MAX_JSON_DEPTH",
    "MAX_TOP_LOGPROBS_NUM",
    "MEMORY_TAGS",
    "WEIGHT_DTYPES",
    "GenerateInput",
    "ProtocolError",
    "SamplingParams",
    "build_generate_response",
    "check_logprob_start",
    "check_prompt",
    "check_prompt_count",
    "check_prompt_length",
    "error_body",
    "finish_abort",
    "finish_length",
    "finish_stop",
    "is_int",
    "is_number",
    "json_depth",
    "logprob_meta",
    "logprob_start",
    "parse_abort_request",
    "parse_bool_param",
    "parse_destroy_weights_update_group",
    "parse_generate_request",
    "parse_init_weights_update_group",
    "parse_json_body",
    "parse_load_lora_adapter",
    "parse_memory_tags",
    "parse_sampling_params",
    "parse_unload_lora_adapter",
    "parse_update_weight_version",
    "parse_update_weights_from_disk",
    "parse_update_weights_from_distributed",
    "parse_weight_version",
    "scores_prompt",
    "token_triples",
    "top_triples",
]
