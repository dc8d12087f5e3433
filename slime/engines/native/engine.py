"""The embedded native inference engine: model + continuous-batching scheduler + sampling.

Pure PyTorch over the Hugging Face class the trainer uses
(`AutoModelForCausalLM`, sdpa attention), so rollout log-probs agree with training.

Scheduler (one dedicated worker thread, `NativeEngine._loop`)::

    while work:
        retire aborted rows
        admit waiting requests (bounded by --max-running-requests and a prefill token
          budget): prefill them together (left padded; identical prompts, e.g. the n
          samples of one prompt, are prefilled once and their cache rows repeated),
          sample their first token, merge their KV rows into the running batch
        one batched decode step for all running rows
        retire finished rows (the last rows move into their slots)

The running batch is one left-padded KV cache preallocated within the
--max-total-tokens budget and written in place (`kv_cache.BatchKV`; the Hugging Face
forward sees it as a `DynamicCache`), with a 2-D attention mask and explicit position
ids (the count of real tokens before each one), so a padded row gives the same logits
as an unpadded forward. Each step holds `_step_lock`; weight updates take the same lock
between steps (and get priority over the next step).

Deterministic mode (`deterministic=True`, `--enable-deterministic-inference`): every sequence
is its own forward and is sampled alone from its own generator (`batch_invariant.py`), so its
tokens and log-probs are bitwise the same whatever shares its batch.

Prompt log-probs (`logprob_start_len`, scoring with `max_new_tokens: 0`) and top log-probs
(`top_logprobs_num`) are computed in `logprobs.py`: a forward of the prompt at admission, top-k at sampling.

Routed experts (`return_routed_experts`, MoE models) are recorded in the forwards of batches where
a request asks for them and kept per request (`routing.py`).

LoRA adapters (`lora.py`) ride on forward hooks: each request names its adapter (or none), the
rows of one batch may mix them, and prefill dedup keys on (adapter, prompt).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

from slime.engines.native import batch_invariant
from slime.engines.native.kv_cache import BatchKV, default_max_total_tokens, kv_bytes_per_token, peak_kv_tokens
from slime.engines.native.lora import EngineLora, LoraState
from slime.engines.native.logprobs import logprob_options, record_output_top, score_prompts
from slime.engines.native.requests import Callback, GenerationResult, Request, TokenHook, eos_token_ids
from slime.engines.native.routing import EngineRouting
from slime.engines.native.sampling import request_seed, sample_next_tokens
from slime.engines.native import vision
from slime.engines.native.weights import EngineWeights
from slime.utils.threads import default_num_threads
from slime.utils.vision import load_lm, own_memory
from slime.engines.protocol import (
    GenerateInput,
    ProtocolError,
    SamplingParams,
    check_prompt,
    finish_abort,
    finish_length,
    parse_sampling_params,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NativeEngine(EngineWeights, EngineLora):
    """A continuous-batching generation engine over a Hugging Face causal LM.

    Thread-safe public methods: `submit`, `generate`, `abort`, `update_weights`,
    `update_weights_from_disk`, `update_weight_version`, `load_lora_adapter`,
    `unload_lora_adapter`, `flush_cache`, `pause`, `resume`, `stats`.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        max_running_requests: int = 128,
        num_threads: int | None = None,
        random_seed: int = 0,
        context_length: int | None = None,
        max_prefill_tokens: int = 16384,
        max_total_tokens: int | None = None,
        deterministic: bool = False,
    ):
        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"model path {model_path!r} is not a directory")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        torch.set_num_threads(num_threads or default_num_threads())
        self.model_path = str(model_path)
        self.tokenizer_path = str(tokenizer_path or model_path)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.random_seed = random_seed
        self.deterministic = deterministic  # batch-invariant numerics (batch_invariant.py)

        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)

        major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"
        self.model = load_lm(self.model_path, attn_implementation="sdpa", **{dtype_kw: self.dtype})
        self.model.to(self.device).eval()
        if self.device.type == "cpu":  # the same numbers before and after a memory release and resume
            own_memory(self.model)
        cfg = self.model.config
        self.vision = vision.processor_of(self)  # images (Qwen-VL models; vision.py), None when text-only
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.num_layers = int(cfg.get_text_config(decoder=True).num_hidden_layers)
        self.max_context_length = int(context_length or getattr(cfg.get_text_config(decoder=True),
                                                                      "max_position_embeddings", None) or 4096)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model)
        pad = self.tokenizer.pad_token_id
        if pad is None or not (0 <= pad < self.vocab_size):
            pad = 0
        self.pad_token_id = int(pad)
        self._params_by_name = dict(self.model.state_dict(keep_vars=True))
        self.routing = EngineRouting(self.model)  # MoE routers wrapped once; records only when asked
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, self.dtype)
        if max_total_tokens is None:
            max_total_tokens = default_max_total_tokens(
                self.kv_bytes_per_token, self.max_running_requests * self.max_context_length, self.device
            )
        if max_total_tokens < 2:
            raise ValueError("max_total_tokens must be >= 2")
        self.max_total_tokens = int(max_total_tokens)

        self.weight_version = "0"
        self._engine_generator = torch.Generator(device=self.device)
        self._engine_generator.manual_seed(random_seed)

        # queues / state guarded by _cv
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []  # rows of the batch, in cache order
        self._admitting: list[Request] = []  # popped from _waiting, being prefilled
        self._abort_pending = False
        self._paused = False
        self._exclusive_waiters = 0
        self._stopping = False
        self._step_lock = threading.Lock()
        # batch tensors (owned by the worker thread, under _step_lock)
        self._kv: BatchKV | None = None  # the running batch's KV cache
        self._last_tokens: torch.Tensor | None = None  # [B] long, sampled but not yet in cache
        self._stats = collections.Counter()
        self._max_batch = 0
        self._kv_tokens = 0  # rows x padded length of the running batch's KV cache
        self._peak_kv_tokens = 0
        self._released: set[str] = set()  # "weights" / "kv_cache" while memory is released
        self._weights_stash = None  # where released weights live (temp dir on CPU, host copies on GPU)
        self._groups: dict = {}  # name -> (process group, rank, world_size, backend)
        self._lora = LoraState()  # loaded LoRA adapters and their forward hooks
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "NativeEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="native-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._cv:
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
        for r in pending:
            if not r.done:
                r.aborted = True
                self._finish(r, finish_abort("engine shut down"))

    # ------------------------------------------------------------------ requests
    def submit(self, inp: GenerateInput, callback: Callback, on_token: TokenHook | None = None,
               routed_experts: bool = False) -> None:
        """Queue one validated request (`inp.input_ids` must be set). `callback(result, error)`
        is called exactly once, from the worker thread or the calling thread.

        `on_token(token_ids, logprobs)`, when given, is called from the worker thread with each
        token as it is sampled, except the one that ends the request (that one arrives only in
        the result): so a streamer never shows a stop token or the token completing a stop
        string. It must be quick and must not block (e.g. `loop.call_soon_threadsafe`). `routed_experts`:
        the result carries the experts each token was routed to (`routing.py`; `routing.check` first).
        `inp.image_data`: decoded here unless `vision.prepare` already did (on the server's prepare thread)."""
        assert inp.input_ids is not None, "tokenize text before submit"
        pixels = vision.prepare(self, inp)
        sp = inp.sampling_params
        gen = None
        seed = request_seed(self.random_seed, inp.rid) if sp.seed is None and self.deterministic else sp.seed
        if seed is not None and not sp.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed % (2**64))
        req = Request(rid=inp.rid, input_ids=list(inp.input_ids), params=sp, callback=callback, generator=gen,
                      on_token=on_token, lora_name=inp.lora_name, routed=[] if routed_experts else None,
                      image_sources=inp.image_data if pixels is not None else None, pixels=pixels,
                      **logprob_options(inp))
        if sp.max_new_tokens == 0 and not req.scores_prompt and req.routed is None:  # nothing to compute
            self._finish(req, finish_length(0))
            return
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            self._stats["requests"] += 1
            self._waiting.append(req)
            self._cv.notify_all()

    def final_length(self, prompt_len: int, params: SamplingParams) -> int:
        """The most KV tokens a request can ever occupy (prompt + max_new_tokens, capped by the context)."""
        return min(prompt_len + max(params.max_new_tokens, 1), self.max_context_length)

    def check_fits(self, input_ids: list[int], params: SamplingParams, name: str = "input_ids",
                   max_new_name: str = "sampling_params.max_new_tokens") -> None:
        """Raise ProtocolError when a request could never fit the KV budget (--max-total-tokens)."""
        if len(input_ids) + 1 > self.max_total_tokens:
            raise ProtocolError(
                name,
                f"the prompt has {len(input_ids)} tokens, more than the KV cache budget allows "
                f"(--max-total-tokens {self.max_total_tokens})",
            )
        need = self.final_length(len(input_ids), params)
        if need > self.max_total_tokens:
            raise ProtocolError(
                max_new_name,
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {need} tokens "
                f"exceeds the KV cache budget (--max-total-tokens {self.max_total_tokens}); lower it to at most "
                f"{self.max_total_tokens - len(input_ids)}",
            )

    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict | SamplingParams | None = None,
        rid: str | None = None,
        timeout: float | None = 600.0,
        lora_name: str | None = None,
        image_data: list | None = None,
    ) -> GenerationResult:
        """Blocking convenience wrapper around `submit` (for in-process use and tests)."""
        sp = sampling_params if isinstance(sampling_params, SamplingParams) else parse_sampling_params(sampling_params)
        check_prompt(list(input_ids), self.vocab_size, self.max_context_length)
        self.check_fits(list(input_ids), sp)
        self.check_lora(lora_name)
        done = threading.Event()
        box: list = []

        def cb(res, err):
            box.append((res, err))
            done.set()

        self.submit(GenerateInput(rid=rid or uuid.uuid4().hex, sampling_params=sp, input_ids=list(input_ids),
                                  lora_name=lora_name, image_data=image_data), cb)
        if not done.wait(timeout):
            raise TimeoutError(f"generation did not finish within {timeout}s")
        res, err = box[0]
        if err is not None:
            raise err
        return res

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort a request by rid (or all). Returns how many were found. Aborted requests
        return their partial output with finish_reason type 'abort'."""
        n = 0
        to_finish = []
        with self._cv:
            for r in list(self._waiting):
                if abort_all or r.rid == rid:
                    self._waiting.remove(r)
                    r.aborted = True
                    to_finish.append(r)
                    n += 1
            for r in self._running + self._admitting:
                if (abort_all or r.rid == rid) and not r.done:
                    r.aborted = True
                    n += 1
                    self._abort_pending = True
            self._cv.notify_all()
        for r in to_finish:
            self._finish(r, finish_abort())
        return n

    def pause(self) -> None:
        with self._cv:
            self._paused = True
        with self._step_lock:  # wait for the step in flight
            pass

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def flush_cache(self) -> bool:
        """No prefix cache survives between requests yet, so there is nothing to drop."""
        return True

    def stats(self) -> dict:
        with self._cv:
            return {
                "num_running_requests": len(self._running),
                "num_waiting_requests": len(self._waiting),
                "max_running_batch_size": self._max_batch,
                "max_running_requests": self.max_running_requests,
                "total_requests": self._stats["requests"],
                "total_prefill_tokens": self._stats["prefill_tokens"],
                "total_generated_tokens": self._stats["generated_tokens"],
                "prefill_batches": self._stats["prefill_batches"],
                "shared_prefix_rows": self._stats["shared_prefix_rows"],
                "decode_steps": self._stats["decode_steps"],
                "weight_version": self.weight_version,
                "paused": self._paused,
                "max_total_tokens": self.max_total_tokens,
                "kv_tokens": self._kv_tokens,
                "peak_kv_tokens": self._peak_kv_tokens,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "memory_released": sorted(self._released),
                "weight_updates": self._stats["weight_updates"],
                "deterministic": self.deterministic,
                "lora_adapters": self.lora_adapters(),
            }

    # ------------------------------------------------------------------ weights
    def _exclusive(self):
        engine = self

        class _Ctx:
            def __enter__(self_inner):
                with engine._cv:
                    engine._exclusive_waiters += 1
                engine._step_lock.acquire()

            def __exit__(self_inner, *exc):
                engine._step_lock.release()
                with engine._cv:
                    engine._exclusive_waiters -= 1
                    engine._cv.notify_all()

        return _Ctx()

    # ------------------------------------------------------------------ worker
    def _has_work(self) -> bool:
        if self._paused or self._released:
            return self._abort_pending
        return bool(self._waiting) or bool(self._running) or self._abort_pending

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and (self._exclusive_waiters > 0 or not self._has_work()):
                    self._cv.wait()
                if self._stopping:
                    return
            with self._step_lock:
                try:
                    with torch.inference_mode():
                        self._step()
                except BaseException as e:  # noqa: BLE001 - fail the batch, keep serving
                    logger.exception("native engine step failed")
                    self._fail_all(e)

    def _fail_all(self, err: BaseException) -> None:
        with self._cv:
            rows = list(self._running) + list(self._admitting)
            self._running = []
            self._admitting = []
        self._kv = self._last_tokens = None
        self._kv_tokens = 0
        for r in rows:
            if not r.done:
                r.done = True
                try:
                    r.callback(None, err)
                except Exception:  # noqa: BLE001
                    logger.exception("callback failed")

    def _step(self) -> None:
        with self._cv:
            self._abort_pending = False
            paused = self._paused or bool(self._released)
        # 1. aborted rows leave the batch
        if any(r.aborted for r in self._running):
            for r in self._running:
                if r.aborted and r.finish is None:
                    r.finish = finish_abort()
            self._retire()
        if paused:
            return
        # 2. admit
        admitted = []
        with self._cv:
            budget = self.max_prefill_tokens
            rows = self._kv_rows()
            while self._waiting and len(self._running) + len(admitted) < self.max_running_requests:
                nxt = self._waiting[0]
                if admitted and len(nxt.input_ids) > budget:
                    break
                row = (len(nxt.input_ids) + 1, self.final_length(len(nxt.input_ids), nxt.params))
                if peak_kv_tokens(rows + [row]) > self.max_total_tokens:
                    break  # waits until running rows finish and free KV
                rows.append(row)
                budget -= len(nxt.input_ids)
                admitted.append(self._waiting.popleft())
                admitted[-1].admitted = time.perf_counter()
            self._admitting = admitted
        for r in self._lora_missing(admitted):  # their adapter was unloaded while they waited
            self._finish(r, r.finish)
        admitted = score_prompts(self, [r for r in admitted if r.finish is None])  # prompt-only ones finish here
        if admitted:
            for group in vision.prefill_groups(admitted):  # images: each prompt alone (vision.py)
                self._prefill(group)
            self._retire()
        else:
            with self._cv:
                self._admitting = []
        # 3. one decode step for the running batch
        if self._lora_missing(self._running):
            self._retire()
        if self._running:
            self._decode()
            self._retire()

    def _kv_rows(self) -> list[tuple[int, int]]:
        """(length after the next decode step, final length) of every running row."""
        return [
            (len(r.input_ids) + len(r.output_ids), self.final_length(len(r.input_ids), r.params))
            for r in self._running
        ]

    def _note_kv(self) -> None:
        n = 0 if self._kv is None else self._kv.allocated_tokens
        self._kv_tokens = n
        if n > self._peak_kv_tokens:
            self._peak_kv_tokens = n

    # ---- batch tensor plumbing
    def _prefill(self, reqs: list[Request]) -> None:
        # identical prompts (n samples of one prompt) are prefilled once
        uniq: dict[tuple, int] = {}
        row_of = []
        prompts = []
        loras = []  # the adapter of each prefilled row
        for r in reqs:
            key = (r.lora_name, tuple(r.input_ids))
            if key not in uniq:
                uniq[key] = len(prompts)
                prompts.append(r.input_ids)
                loras.append(r.lora_name)
            row_of.append(uniq[key])
        n = len(prompts)
        with self.routing.record(reqs) as rec:
            if reqs[0].pixels is not None:  # one prompt with images (vision.prefill_groups)
                kv, logits = vision.prefill_one(self, reqs)
            elif self.deterministic:
                kv, logits = batch_invariant.prefill_rows(self, prompts, loras)
            else:
                kv, logits = self._prefill_batch(prompts, loras)
        self.routing.add_prefill(rec, reqs, row_of, prompts, per_row=self.deterministic)
        if n != len(reqs):
            logits = logits.index_select(0, torch.tensor(row_of, dtype=torch.long, device=self.device))
        with self._cv:
            self._stats["prefill_tokens"] += sum(len(p) for p in prompts)
            self._stats["prefill_batches"] += 1
            self._stats["shared_prefix_rows"] += len(reqs) - len(prompts)
        tokens = self._sample(logits, reqs)
        # merge into the running batch
        if self._kv is None:
            self._kv, self._last_tokens = kv.take(row_of), tokens
        else:
            self._kv.add_rows(kv, row_of, self.max_total_tokens)
            self._last_tokens = torch.cat([self._last_tokens, tokens], 0)
        with self._cv:
            self._running.extend(reqs)
            self._admitting = [r for r in self._admitting if all(r is not q for q in reqs)]
            self._max_batch = max(self._max_batch, len(self._running))
        self._note_kv()
        self._append_tokens(reqs, tokens)

    def _prefill_batch(self, prompts: list[list[int]], loras: list[str | None]) -> tuple[BatchKV, torch.Tensor]:
        """One left-padded forward of all prompts: (their cache, last-position logits [n, V] float)."""
        n, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, L), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, L - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        kv = BatchKV(n, L, self.device)
        kv.prefill_mask(mask)
        with self._lora_rows(loras):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=kv.hf_cache(self.num_layers),
                use_cache=True,
                logits_to_keep=1,
            )
        kv.advance(L)
        return kv, out.logits[:, -1, :].float()

    def _decode(self) -> None:
        with self.routing.record(self._running) as rec:
            if self.deterministic:
                logits = batch_invariant.decode_rows(self, self._kv, self._last_tokens, self._running)
            else:
                logits = self._decode_batch()
        self.routing.add_decode(rec, self._running)
        self._note_kv()
        tokens = self._sample(logits, self._running)
        self._last_tokens = tokens
        with self._cv:
            self._stats["decode_steps"] += 1
        self._append_tokens(self._running, tokens)

    def _decode_batch(self) -> torch.Tensor:
        """One batched decode step: the running rows' next-token logits [B, V] float."""
        kv = self._kv
        kv.reserve_column(self.max_total_tokens)
        pos = vision.decode_positions(kv.positions(), self._running)
        kv.append_column()
        with self._lora_rows([r.lora_name for r in self._running]):
            out = self.model(
                input_ids=self._last_tokens.view(-1, 1),
                attention_mask=kv.attention_mask(1),
                position_ids=pos,
                past_key_values=kv.hf_cache(self.num_layers),
                use_cache=True,
            )
        kv.advance(1)
        return out.logits[:, -1, :].float()

    def _retire(self) -> None:
        """Finish rows that have a finish reason; drop them from the batch tensors."""
        rows = self._running
        keep = [i for i, r in enumerate(rows) if r.finish is None]
        if len(keep) == len(rows):
            return
        finished = [r for r in rows if r.finish is not None]
        if not keep:
            self._kv = self._last_tokens = None
            with self._cv:
                self._running = []
        else:
            order = self._kv.remove_rows(keep)
            self._last_tokens = self._last_tokens.index_select(0, torch.tensor(order, device=self.device))
            with self._cv:
                self._running = [rows[i] for i in order]
        self._note_kv()
        for r in finished:
            self._finish(r, r.finish)

    # ---- sampling
    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Sample one token per row and record each row's log-prob of it (and top log-probs, when asked)."""
        record_output_top(logits, reqs)
        if self.deterministic:
            tokens, token_lp = batch_invariant.sample_rows(logits, reqs, self._engine_generator)
        else:
            tokens, token_lp = sample_next_tokens(
                logits, [r.params for r in reqs], [r.generator for r in reqs], self._engine_generator
            )
        for r, lp in zip(reqs, token_lp.tolist()):
            r.logprobs.append(lp)
        return tokens

    def _append_tokens(self, reqs: list[Request], tokens: torch.Tensor) -> None:
        for r, t in zip(reqs, tokens.tolist()):
            r.add_token(t, self.eos_token_ids, self.max_context_length, self.tokenizer)
        with self._cv:
            self._stats["generated_tokens"] += len(reqs)

    def _finish(self, r: Request, finish: dict) -> None:
        r.complete(finish, self.weight_version, self.tokenizer)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]
