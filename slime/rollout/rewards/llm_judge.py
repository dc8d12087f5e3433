"""An LLM-judge reward (`--rm-type llm_judge --judge-template PATH [--judge-model NAME]`): a model
served beside the policy (`--sglang-config`) grades each sample, and the number in its answer is the
reward.

For each sample the template (`slime.reward_flags.JudgeTemplate`, docs/custom_rollout.md "LLM
judge") is filled with the sample's prompt, response and label:
- `{prompt}`: a string prompt as is; a chat prompt (a list of messages) as its one user message's
  content, or, for several messages, each as `role: content`, separated by blank lines;
- `{response}`: `sample.response`; `{label}`: `str(sample.label)` ("" when there is none).
The optional system message and the user message are rendered with the JUDGE model's own chat
template (its tokenizer, loaded once per process from the served model's directory, with a
generation prompt); a tokenizer without a chat template gets the plain text `system\\n\\nuser`.
The text goes to the judge's engines as one SGLang-native `/generate` call
(`context().model(--judge-model).generate`, looked up at the first call) with the template's
`temperature` and `max_new_tokens`.

The score is the number captured by the pattern's last match in the judge's answer, divided by
`max_score` when the template gives one. An answer without a match, a capture that is not a finite
number, or an aborted judge call raises, so `slime.rollout.generate.score` marks the sample FAILED
(counted, kept out of the loss): never scored 0. Each call may take `--rm-timeout` seconds, and the
calls that wait for the judge's tokenizer to load `LOAD_TIMEOUT_S` more.
"""

from __future__ import annotations

import asyncio
import os
import threading

from slime.reward_flags import JudgeTemplate, judge_model_path, load_judge_template
from slime.rollout.api import context

LOAD_TIMEOUT_S = 120.0  # what loading the judge's tokenizer may add to the first calls' --rm-timeout

_TOKENIZERS: dict[str, object] = {}
_TOKENIZERS_LOCK = threading.Lock()


def judge_tokenizer(path: str):
    """The process's tokenizer of the judge model directory `path` (loaded once; blocking)."""
    key = os.path.realpath(path)
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            from transformers import AutoTokenizer  # here: the driver imports this module

            _TOKENIZERS[key] = AutoTokenizer.from_pretrained(path)
        return _TOKENIZERS[key]


def _content(content) -> str:
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: the text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def prompt_text(prompt) -> str:
    """What `{prompt}` stands for (module docstring)."""
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt or ())
    if len(messages) == 1 and messages[0].get("role") == "user":
        return _content(messages[0].get("content"))
    return "\n\n".join(f"{m.get('role', '')}: {_content(m.get('content'))}" for m in messages)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The judge's input text: its chat template with a generation prompt, or, without a chat
    template, the messages' contents separated by blank lines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages)


class LLMJudgeReward:
    """`--rm-type llm_judge`: `await reward(args, sample)` -> the judge's score of the sample."""

    def __init__(self, args, template: JudgeTemplate | None = None):
        self.model = args.judge_model
        self.model_path = judge_model_path(args, self.model)
        if self.model_path is None:
            raise ValueError(f"--judge-model {self.model}: the run serves no model of that name (--sglang-config)")
        self.template = template if template is not None else load_judge_template(args.judge_template)
        self.rm_timeout = args.rm_timeout
        self._pool = None

    @property
    def total_timeout(self) -> float:
        """`--rm-timeout` per call, plus `LOAD_TIMEOUT_S` while the judge's tokenizer is not loaded."""
        loaded = os.path.realpath(self.model_path) in _TOKENIZERS
        return self.rm_timeout + (0.0 if loaded else LOAD_TIMEOUT_S)

    def pool(self):
        """The judge's engine pool (looked up at the first call: the engines are up by then)."""
        if self._pool is None:
            self._pool = context().model(self.model)
        return self._pool

    async def request(self, sample) -> dict:
        """The `/generate` payload that asks the judge about `sample`."""
        tokenizer = await asyncio.to_thread(judge_tokenizer, self.model_path)
        label = "" if sample.label is None else str(sample.label)
        messages = self.template.messages(prompt_text(sample.prompt), sample.response or "", label)
        return {"text": render_chat(tokenizer, messages), "sampling_params": self.template.sampling_params()}

    async def __call__(self, args, sample) -> float:
        out = await self.pool().generate(await self.request(sample))
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise RuntimeError(f"judge {self.model}: the call was aborted ({finish.get('message', '')})")
        return self.template.parse(out.get("text") or "")
