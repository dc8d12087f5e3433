"""The names `--rm-type` accepts (`RM_TYPES`) and refuses with a reason (`UNAVAILABLE_RM_TYPES`).

Defined in `slime.utils.reward_names` (import-free, so the argument parser can read them without
importing this package's reward implementations); re-exported here beside those implementations.
"""

from __future__ import annotations

from slime.utils.reward_names import (
    BOXED_PREFIX,
    RESPONSE_RM_TYPES,
    RM_TYPES,
    UNAVAILABLE_RM_TYPES,
    unavailable_message,
)

__all__ = ["BOXED_PREFIX", "RESPONSE_RM_TYPES", "RM_TYPES", "UNAVAILABLE_RM_TYPES", "unavailable_message"]
