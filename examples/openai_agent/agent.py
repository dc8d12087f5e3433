"""An agent written only against the OpenAI chat API, trained through slime.

    --custom-generate-function-path examples/openai_agent/agent.py:generate
    --custom-rm-path examples/openai_agent/reward.py:reward --reward-key score
    --custom-config-path examples/openai_agent/config.yaml

`answer_then_check` is ordinary agent code: it knows nothing of tokens or slime, only an
`openai.AsyncOpenAI` client and chat messages. It asks the question, shows the model its draft
with a request to check it, and returns the final reply. `generate` runs it through
`slime.rollout.openai_agent.run_agent`, whose client points at the rollout engines' OpenAI endpoint
(`/v1/chat/completions`) and records every call's prompt and output token ids and log-probs: the
episode becomes a Sample whose loss mask is 1 on both replies of the model and 0 on the check
request between them (or several Samples, when a later prompt does not extend the earlier one).

Config keys: `check_prompt` (the second user message), `max_tokens_per_call`.
"""

from __future__ import annotations

from functools import partial

from slime.rollout.openai_agent import run_agent

CHECK_PROMPT = "Check your answer. Then reply with only the final result."


async def answer_then_check(client, model: str, question: list[dict] | str, *, check_prompt: str = CHECK_PROMPT,
                            max_tokens: int | None = None) -> str:
    """Two chat calls: a draft answer, then a checked final answer (returned)."""
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else list(question)
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    draft = await client.chat.completions.create(model=model, messages=messages, **extra)
    messages += [{"role": "assistant", "content": draft.choices[0].message.content or ""},
                 {"role": "user", "content": check_prompt}]
    final = await client.chat.completions.create(model=model, messages=messages, **extra)
    return final.choices[0].message.content or ""


async def generate(args, sample, sampling_params):
    agent = partial(answer_then_check, check_prompt=getattr(args, "check_prompt", CHECK_PROMPT),
                    max_tokens=getattr(args, "max_tokens_per_call", None))
    return await run_agent(lambda client, model, s: agent(client, model, s.prompt), args, sample, sampling_params)
