"""Token sampling for the native engine: temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from slime.engines.protocol import SamplingParams


def sample_next_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    engine_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V].

    Returns (tokens [B] long, log-probs [B] float): each row's token and its log-prob under
    log_softmax(logits / T) (T = the row's temperature, 1 for greedy) before top-k/top-p
    truncation. Rows with their own generator (a request seed) draw from it alone, so
    their samples do not depend on the rest of the batch.
    """
    B, V = logits.shape
    temps = torch.tensor([p.logprob_temperature for p in params], dtype=torch.float32, device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logits.argmax(-1)
    sample_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sample_rows:
        idx = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
        probs = logp.index_select(0, idx).exp()
        sub = [params[i] for i in sample_rows]
        need_k = any(p.top_k != -1 and p.top_k < V for p in sub)
        need_p = any(p.top_p < 1.0 for p in sub)
        if need_k or need_p:
            sp, si = probs.sort(-1, descending=True)
            if need_p:
                top_p = torch.tensor([p.top_p for p in sub], dtype=torch.float32, device=logits.device)
                cum = sp.cumsum(-1)
                sp = sp.masked_fill((cum - sp) > top_p[:, None], 0.0)
            if need_k:
                ks = torch.tensor([p.top_k if p.top_k != -1 else V for p in sub], device=logits.device)
                ranks = torch.arange(V, device=logits.device)
                sp = sp.masked_fill(ranks[None, :] >= ks[:, None], 0.0)
        else:
            sp, si = probs, None
        chosen = torch.empty(len(sample_rows), dtype=torch.long, device=logits.device)
        shared = [j for j, i in enumerate(sample_rows) if generators[i] is None]
        if shared:
            js = torch.tensor(shared, dtype=torch.long, device=logits.device)
            chosen[js] = torch.multinomial(sp.index_select(0, js), 1, generator=engine_generator).view(-1)
        for j, i in enumerate(sample_rows):
            g = generators[i]
            if g is not None:
                chosen[j] = torch.multinomial(sp[j : j + 1], 1, generator=g).view(-1)[0]
        if si is not None:
            chosen = si.gather(1, chosen[:, None]).view(-1)
        tokens[idx] = chosen
    return tokens, logp.gather(1, tokens[:, None]).view(-1)
