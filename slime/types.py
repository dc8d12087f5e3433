"""Typed records that flow between data, rollout and training.

`Sample` is one prompt/response pair as rollout produces it. `RolloutBatch` is the
column-oriented training data the rollout manager hands to the train actors: one
entry per sample, in step order (see `RolloutBatch.split_for_ranks`).
"""

from __future__ import annotations

import base64
import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # stopped on EOS, a stop string or a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One prompt and one generated response.

    `tokens` holds prompt + response token ids; the response is the last
    `response_length` of them. `loss_mask`, `rollout_log_probs` and (on-policy distillation
    with a served teacher) `teacher_log_probs` have one entry per response token (loss mask 0
    marks tool/environment tokens).
    """

    prompt: str | list[dict[str, Any]] = ""
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int = -1  # position of the sample within its rollout
    group_index: int = -1  # the n samples of one prompt share it
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    # --opd-type sglang: the served teacher's log-prob of each response token (slime.rollout.teacher)
    teacher_log_probs: list[float] | None = None
    # --use-rollout-routing-replay: the experts the engine routed every token but the last to,
    # Tensor[len(tokens) - 1 (or fewer: tokens appended after the last engine call), MoE layers x top-k] int32
    rollout_routed_experts: Any = None
    # vision-language models (--multimodal-keys): the prompt's images, then those environment turns added,
    # as sources (paths, file:// or data: URLs, base64; slime.utils.vision), in the order of their slots
    images: list[str] | None = None
    reward: float | dict[str, float] | None = None
    # a dict reward as the reward function returned it; `reward` is then its --reward-key entry
    reward_dict: dict[str, Any] | None = None
    status: SampleStatus = SampleStatus.PENDING
    weight_version: int | None = None  # the policy version that wrote the last response token
    # every policy version that wrote part of the response, oldest first (several after a partial
    # rollout resumes the sample, or when weights change under a request in fully async rollout)
    weight_versions: list[int] = field(default_factory=list)
    # set by a --rollout-sample-filter-path function: the sample stays in the batch but trains on nothing
    remove_sample: bool = False
    # timeline spans: where the sample's wall time went (slime.observability.spans; docs/timeline.md)
    spans: list[dict[str, Any]] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields (what checkpoints and rollout dumps store); routed experts as
        {"shape", "int32_base64"}."""
        d = dict(asdict(self), status=self.status.value)
        routed = d["rollout_routed_experts"]
        if routed is not None:
            d["rollout_routed_experts"] = {"shape": list(routed.shape), "int32_base64": base64.b64encode(
                routed.to(torch.int32).contiguous().numpy().tobytes()).decode()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        routed = d.get("rollout_routed_experts")
        if routed is not None:
            flat = torch.frombuffer(bytearray(base64.b64decode(routed["int32_base64"])), dtype=torch.int32)
            d = dict(d, rollout_routed_experts=flat.reshape(routed["shape"]))
        return cls(**dict(d, status=SampleStatus(d["status"])))

    def staleness(self, policy_version: int) -> int:
        """Policy versions between the oldest weights that wrote this response and `policy_version`."""
        return policy_version - min(self.weight_versions) if self.weight_versions else 0

    def reset_response(self) -> None:
        """Drop the response (back to the bare prompt), e.g. to regenerate a sample that is too stale."""
        self.tokens = self.tokens[: self.prompt_length]
        self.response, self.response_length = "", 0
        self.loss_mask = self.rollout_log_probs = self.teacher_log_probs = self.rollout_routed_experts = None
        self.reward = self.reward_dict = None
        self.status = SampleStatus.PENDING
        self.weight_version, self.weight_versions = None, []

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    # -- multi-turn: the response grows turn by turn, never re-tokenized --------------------
    def append_model_tokens(self, token_ids: list[int], log_probs: list[float]) -> None:
        """Tokens the policy generated: trained on (loss mask 1), with their rollout log-probs."""
        if len(log_probs) != len(token_ids):
            raise ValueError(f"{len(log_probs)} log-probs for {len(token_ids)} model tokens")
        self._extend(token_ids, 1, [float(x) for x in log_probs])

    def append_env_tokens(self, token_ids: list[int], images: list[str] | None = None) -> None:
        """Tokens the environment wrote (tool results, user turns, chat-template glue): part of the
        context the next turn sees, never trained on (loss mask 0; log-prob placeholder 0.0).
        `images`: the sources of the images whose (expanded) slots `token_ids` hold, in order; they
        follow the sample's earlier images in `images` (slime.rollout.multiturn.env_image_tokens)."""
        self._extend(token_ids, 0, [0.0] * len(token_ids))
        if images:  # a new list: the n samples of a prompt start from the same one
            self.images = [*(self.images or []), *images]

    def _extend(self, token_ids: list[int], mask: int, log_probs: list[float]) -> None:
        if self.loss_mask is None:
            self.loss_mask = []
        if self.rollout_log_probs is None:
            self.rollout_log_probs = []
        if len(self.loss_mask) != self.response_length or len(self.rollout_log_probs) != self.response_length:
            raise ValueError("loss_mask/rollout_log_probs out of step with response_length")
        ids = [int(t) for t in token_ids]
        self.tokens = self.tokens + ids
        self.response_length += len(ids)
        self.loss_mask = self.loss_mask + [mask] * len(ids)
        self.rollout_log_probs = self.rollout_log_probs + log_probs
        self.teacher_log_probs = None  # scored for the shorter response: the teacher scores it again


@dataclass
class RolloutBatch:
    """Training data for one rollout, one list entry per sample.

    `rewards` are what advantages are built from (already normalized per group for
    GRPO-style estimators); `raw_rewards` are the scores as the reward function gave them.
    `teacher_log_probs` (`--opd-type sglang`; else None) are the served teacher's log-probs of
    each sample's response tokens (None for a sample the teacher did not score: a failed one).
    """

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    rewards: list[float]
    raw_rewards: list[float]
    rollout_log_probs: list[list[float]]
    group_indices: list[int]
    teacher_log_probs: list[list[float] | None] | None = None
    # --use-rollout-routing-replay: each sample's engine routing (Sample.rollout_routed_experts)
    routed_experts: list[Any] | None = None
    # vision-language models: each sample's image sources (Sample.images; None for a sample without)
    images: list[list[str] | None] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: list[int]) -> "RolloutBatch":
        """The samples at `indices`, in that order (every per-sample column; absent ones stay None)."""
        columns = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(**{k: None if v is None else [v[i] for i in indices] for k, v in columns.items()})

    def split_for_ranks(self, dp_size: int, global_batch_size: int, balance: bool = False) -> list["RolloutBatch"]:
        """Split for data parallelism, keeping optimizer steps aligned.

        The batch holds `num_steps * global_batch_size` samples; step s uses samples
        [s*gbs, (s+1)*gbs). Rank r gets, for every step s, `gbs/dp` of that step's samples,
        so every rank's local batch is `num_steps` chunks of `gbs/dp` samples in step order:
        by default the contiguous slice [s*gbs + r*gbs/dp, s*gbs + (r+1)*gbs/dp); with
        `balance` (`--balance-data`) the step's samples are dealt so that every rank gets
        about the same number of tokens (`balanced_rank_assignment`). Either way a step
        trains on the same samples with the same per-token loss weights, so the loss and
        the gradients do not change, only which rank computes which part of them.
        """
        return [self.select(idx) for idx in self.rank_indices(dp_size, global_batch_size, balance)]

    def rank_indices(self, dp_size: int, global_batch_size: int, balance: bool = False) -> list[list[int]]:
        """The sample indices of every rank's local batch (see `split_for_ranks`)."""
        n = len(self)
        if n % global_batch_size or global_batch_size % dp_size:
            raise ValueError(
                f"cannot split {n} samples into steps of global batch {global_batch_size} over {dp_size} ranks"
            )
        per_rank = global_batch_size // dp_size
        out: list[list[int]] = [[] for _ in range(dp_size)]
        for s in range(n // global_batch_size):
            step = list(range(s * global_batch_size, (s + 1) * global_batch_size))
            if balance:
                parts = balanced_rank_assignment([len(self.tokens[i]) for i in step], dp_size)
                for r in range(dp_size):
                    out[r].extend(step[j] for j in parts[r])
            else:
                for r in range(dp_size):
                    out[r].extend(step[r * per_rank : (r + 1) * per_rank])
        return out


def balanced_rank_assignment(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Deal items with these token counts to `num_ranks` ranks, the same number of items each,
    balancing the ranks' token sums: longest first, each to the rank with the fewest tokens
    among those that still have room (ties: the lower rank). Returns each rank's item
    positions in ascending order. Deterministic; `len(lengths)` must divide by `num_ranks`.
    """
    n = len(lengths)
    if num_ranks < 1 or n % num_ranks:
        raise ValueError(f"cannot deal {n} items evenly over {num_ranks} ranks")
    cap = n // num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for j in sorted(range(n), key=lambda j: (-lengths[j], j)):
        r = min((r for r in range(num_ranks) if len(parts[r]) < cap), key=lambda r: (load[r], r))
        parts[r].append(j)
        load[r] += lengths[j]
    return [sorted(p) for p in parts]
