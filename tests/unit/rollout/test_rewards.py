import pytest

from slime.rollout.rewards import exact_reward, get_reward_function, math_reward


@pytest.mark.parametrize("response,label,expected", [
    ("The answer is 7", "7", 1.0),
    ("so 3+4 = \\boxed{7}.", "7", 1.0),
    ("answer: 8", "7", 0.0),
    ("1/2", "0.5", 1.0),
    ("no number here", "3", 0.0),
    ("Answer: -12", "-12", 1.0),
])
def test_math_reward(response, label, expected):
    assert math_reward(response, label) == expected


def test_exact_reward():
    assert exact_reward(" yes\n", "yes") == 1.0
    assert exact_reward("yes!", "yes") == 0.0


def test_unknown_rm_type():
    with pytest.raises(ValueError, match="unknown --rm-type 'nope'"):
        get_reward_function("nope")
