"""A model-based reward (`--rm-type reward_model --rm-path DIR`): a Hugging Face
sequence-classification reward model (`AutoModelForSequenceClassification`, num_labels 1) run in
the rollout process.

The reward of a sample is the model's scalar logit for prompt + response, formatted as TRL's
GRPOTrainer formats reward-model inputs:
- a chat prompt (a list of messages), or any prompt under `--apply-chat-template`: the reward
  model's own chat template on the prompt's messages (a string prompt is one user message) plus
  `{"role": "assistant", "content": response}`, without a generation prompt, tokenized without
  adding special tokens (the template writes them);
- otherwise the plain text `prompt + response`, tokenized as `tokenizer(text)` does (with the
  tokenizer's own special tokens, e.g. BOS).
A sequence longer than the model's `max_position_embeddings` keeps its last tokens (it is cut from
the left, i.e. from the start of the prompt; a warning counts them).

The model is loaded once per process (lazily, on first use; cached by path) in fp32 on CUDA when
the process has one, else on CPU, in eval mode. Scoring runs in a worker thread; the samples that
arrive within `WAIT_S` of each other (up to `MAX_BATCH`) are scored by one right-padded forward, and
the score of each row is taken at its last token that is not the pad token, as transformers'
`...ForSequenceClassification` does (`pad_token_id` is set from the tokenizer's pad or EOS token
when the model's config has none). Each call may take `--rm-timeout` seconds, and the calls made
before the model is loaded `LOAD_TIMEOUT_S` more. A failure (no chat template, an empty input, an
error in the forward) raises, which marks the sample FAILED (`slime.rollout.generate.score`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

MAX_BATCH = 16  # samples per forward
WAIT_S = 0.005  # how long the first sample of a batch waits for others
LOAD_TIMEOUT_S = 600.0  # what loading the model may add to the first calls' --rm-timeout


class RewardModel:
    """One reward model directory: the tokenizer and model (loaded on first use) and the batcher."""

    def __init__(self, path: str, max_batch: int = MAX_BATCH, wait_s: float = WAIT_S):
        self.path = path
        self.tokenizer = None
        self.model = None
        self.device = None
        self.max_len: int | None = None
        self._lock = threading.Lock()  # one load, one batch at a time
        self._batcher = _Batcher(self.score_batch, max_batch, wait_s)

    def load(self) -> None:
        with self._lock:
            if self.model is not None:
                return
            from transformers import AutoModelForSequenceClassification, AutoTokenizer  # here: the driver imports this module

            tokenizer = AutoTokenizer.from_pretrained(self.path)
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=torch.float32)
            model.to(device).eval()
            config = model.config.get_text_config()
            if config.pad_token_id is None:  # transformers finds each row's last token by it
                pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
                if pad is None:
                    raise ValueError(f"--rm-path {self.path}: neither the model config nor the tokenizer has a pad "
                                     "or EOS token; set pad_token_id in config.json")
                config.pad_token_id = model.config.pad_token_id = pad
            self.max_len = getattr(config, "max_position_embeddings", None)
            self.tokenizer, self.device, self.model = tokenizer, device, model

    def text(self, prompt, response: str, chat: bool) -> str:
        """The text the reward model scores (module docstring)."""
        if not chat:
            return prompt + response
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"--rm-path {self.path}: the reward model's tokenizer has no chat template, and the "
                             "prompt is a chat (or --apply-chat-template is on)")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return self.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}],
                                                  tokenize=False)

    def score_batch(self, items: list[tuple]) -> list:
        """Score (prompt, response, chat) items with one padded forward: a float, or the exception of
        an item that could not be formatted, per item. Blocking (runs in a worker thread); one batch at
        a time (the tokenizer is not safe to share between threads)."""
        self.load()
        with self._lock:
            return self._score_batch(items)

    def _score_batch(self, items: list[tuple]) -> list:
        out: list = [None] * len(items)
        rows: list[tuple[int, list[int]]] = []
        truncated = 0
        for i, (prompt, response, chat) in enumerate(items):
            try:
                ids = self.tokenizer(self.text(prompt, response, chat), add_special_tokens=not chat)["input_ids"]
                if not ids:
                    raise ValueError("the reward model input is empty (no prompt and no response tokens)")
            except Exception as e:
                out[i] = e
                continue
            if self.max_len and len(ids) > self.max_len:
                ids, truncated = ids[-self.max_len:], truncated + 1
            rows.append((i, ids))
        if truncated:
            logger.warning("reward model %s: %d of %d inputs longer than max_position_embeddings %d, cut from the "
                           "left", self.path, truncated, len(items), self.max_len)
        if rows:
            for (i, _), value in zip(rows, self._forward([ids for _, ids in rows])):
                out[i] = value
        return out

    def _forward(self, rows: list[list[int]]) -> list[float]:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.model.config.get_text_config().pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):  # right padding
            input_ids[j, :len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[j, :len(r)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids.to(self.device),
                                attention_mask=attention_mask.to(self.device)).logits
        return logits[:, 0].float().cpu().tolist()

    async def score(self, prompt, response: str, chat: bool) -> float:
        """The reward of one sample, scored in a batch with the samples that arrive with it."""
        return await self._batcher.submit((prompt, response, chat))


class _Batcher:
    """Collects the items submitted within `wait_s` of the first (up to `max_batch`) and runs
    `run_batch(items) -> [value or exception per item]` on them in a worker thread."""

    def __init__(self, run_batch, max_batch: int, wait_s: float):
        self.run_batch, self.max_batch, self.wait_s = run_batch, max_batch, wait_s
        self._loop = None
        self._pending: list = []
        self._timer = None
        self._tasks: set = set()

    async def submit(self, item):
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (each asyncio.run): start afresh
            self._loop, self._pending, self._timer, self._tasks = loop, [], None, set()
        future = loop.create_future()
        self._pending.append((item, future))
        if len(self._pending) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = self._loop.create_task(self._run(batch))
            self._tasks.add(task)  # keep a reference until it is done
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list) -> None:
        batch = [(item, f) for item, f in batch if not f.done()]  # a timed-out sample was cancelled
        if not batch:
            return
        try:
            results = await asyncio.to_thread(self.run_batch, [item for item, _ in batch])
        except Exception as e:  # the forward failed: every sample of the batch fails
            results = [e] * len(batch)
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


_MODELS: dict[str, RewardModel] = {}
_MODELS_LOCK = threading.Lock()


def get_reward_model(path: str) -> RewardModel:
    """The process's `RewardModel` of `path` (one per directory; loaded on its first score)."""
    key = os.path.realpath(path)
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = RewardModel(path)
        return _MODELS[key]


class RewardModelReward:
    """`--rm-type reward_model`: `await reward(args, sample)` -> the reward model's logit."""

    def __init__(self, path: str, rm_timeout: float):
        self.path = path
        self.rm_timeout = rm_timeout

    @property
    def total_timeout(self) -> float:
        """`--rm-timeout` per call, plus `LOAD_TIMEOUT_S` while the model is not loaded yet (the first
        calls wait for the load)."""
        loaded = get_reward_model(self.path).model is not None
        return self.rm_timeout + (0.0 if loaded else LOAD_TIMEOUT_S)

    async def __call__(self, args, sample) -> float:
        chat = isinstance(sample.prompt, list) or bool(getattr(args, "apply_chat_template", False))
        return await get_reward_model(self.path).score(sample.prompt, sample.response or "", chat)
