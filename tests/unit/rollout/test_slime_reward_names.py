"""Original slime's `--rm-type` names (its reward hub): each accepted name scores real example
responses the way original slime does (values checked against its rules: correct, wrong and
malformed answers), and each refused name stops with one line saying why."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from slime.rollout.rewards import REWARD_FUNCTIONS, build_reward, get_reward_function
from slime.rollout.rewards.dapo import normalize_answer
from slime.rollout.rewards.deepscaler import last_boxed
from slime.rollout.rewards.f1 import f1_score
from slime.rollout.rewards.names import RESPONSE_RM_TYPES, RM_TYPES, UNAVAILABLE_RM_TYPES
from slime.types import Sample
from slime.utils.errors import SlimeConfigError

UPSTREAM_NAMES = ("remote_rm", "deepscaler", "dapo", "math", "f1", "gpqa", "ifbench", "random")


def reward(name, response, label, metadata=None):
    args = SimpleNamespace(custom_rm_path=None, rm_type=name, group_rm=False)
    return asyncio.run(build_reward(args)(args, Sample(response=response, label=label, metadata=metadata or {})))


def test_every_original_name_is_accepted_or_refused_with_a_reason():
    for name in UPSTREAM_NAMES + tuple("boxed_" + n for n in UPSTREAM_NAMES):
        assert (name in RM_TYPES) != (name in UNAVAILABLE_RM_TYPES), name
    assert {"math", "exact", "reasoning_gym", "remote_rm"} <= set(RM_TYPES)
    assert set(REWARD_FUNCTIONS) == set(RESPONSE_RM_TYPES)
    for name in RM_TYPES:
        if name not in ("reasoning_gym", "remote_rm", "reward_model", "llm_judge"):  # the prompt, a service or a model
            assert callable(get_reward_function(name)), name


def test_rm_type_none_scores_every_sample_zero():
    """--rm-type none: no task reward (pure on-policy distillation, docs/algorithms.md)."""
    assert {reward("none", r, label) for r, label in [("4", "4"), ("", None), ("x", "y")]} == {0.0}


def test_names_module_is_import_light():
    """The argument parser reads the names: importing them must not import the graders."""
    code = ("import sys, slime.utils.reward_names; "
            "assert 'math_verify' not in sys.modules and 'slime.rollout' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", sorted(UNAVAILABLE_RM_TYPES))
def test_refused_names_fail_with_one_line(name):
    with pytest.raises(SlimeConfigError) as e:
        reward(name, "x", "y")
    msg = str(e.value)
    assert msg.startswith(f"--rm-type {name}: ") and "\n" not in msg
    assert UNAVAILABLE_RM_TYPES[name] in msg
    assert "--custom-rm-path" in UNAVAILABLE_RM_TYPES["ifbench"]


# ---------------------------------------------------------------- deepscaler
@pytest.mark.parametrize("response,label,expected", [
    ("<think>3 + 4 is 7, I think</think>The answer is \\boxed{7}.", "7", 1.0),
    ("<think>...</think>So $x = \\boxed{\\frac{1}{2}}$", "0.5", 1.0),
    ("<think>...</think>\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("<think>...</think>\\boxed{3\\sqrt{3}}", "\\sqrt{27}", 1.0),
    ("<think>...</think>\\boxed{\\text{Monday}}", "Monday", 1.0),
    ("<think>...</think>\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("<think>...</think>\\boxed{34}", "\\boxed{34}", 1.0),  # a boxed label is unboxed
    ("<think>...</think>\\boxed{34}", 34, 1.0),  # numeric labels
    ("<think>a</think><think>b</think>\\boxed{5}", "5", 1.0),  # after the last </think>
    ("###Response so \\boxed{5} ###Response \\boxed{6}", "5", 1.0),  # between the first two markers
    ("<think>...</think>\\boxed{8}", "7", 0.0),  # wrong
    ("<think>...</think>\\boxed{-7}", "7", 0.0),
    ("<think>...</think>\\boxed{Tuesday}", "Monday", 0.0),
    ("<think>\\boxed{7}</think> so it is 7", "7", 0.0),  # boxed only inside the thinking
    ("The answer is \\boxed{7}", "7", 0.0),  # no </think> and no ###Response
    ("<think>...</think>the answer is 7", "7", 0.0),  # no boxed answer
    ("<think>...</think>\\boxed{7", "7", 0.0),  # unclosed box
    ("<think>...</think>\\boxed{7}", "", 0.0),  # empty label
    ("<think>...</think>\\boxed{7}", "\\boxed{7", 0.0),  # broken boxed label
])
def test_deepscaler(response, label, expected):
    assert reward("deepscaler", response, label) == expected


def test_deepscaler_grades_with_math_verify():
    """The one deliberate difference: original slime's sympy check refuses unreduced fractions."""
    assert reward("deepscaler", "<think></think>\\boxed{2/4}", "1/2") == 1.0


def test_deepscaler_rejects_a_non_scalar_label():
    with pytest.raises(TypeError, match="deepscaler"):
        get_reward_function("deepscaler")("<think></think>\\boxed{1}", None)


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\boxed{4}}") == "4"
    assert last_boxed("\\boxed{}") == ""
    for text in ("no box", "\\boxed 3", "\\boxed{3", "\\fbox{3}", "\\boxed{1} then \\boxed {2}"):
        assert last_boxed(text) is None, text


# ---------------------------------------------------------------- dapo
@pytest.mark.parametrize("response,label,score,pred", [
    ("Adding them up gives 34.\nAnswer: 34", "34", 1.0, "34"),
    ("answer : 34\nthat is all", "34", 1.0, "34"),  # any case, space before the colon
    ("Answer: $\\boxed{34}$", "34", 1.0, "34"),
    ("Answer: 1,000", "1000", 1.0, "1000"),
    ("Answer: x = 5", "5", 1.0, "5"),  # the part after the last '='
    ("Answer: 90 degrees", "90", 1.0, "90"),  # units removed
    ("Answer: 34", "34.0", 1.0, "34"),  # the label as an integer
    ("Answer: 7\nAnswer: 34", "34", 1.0, "34"),  # the last Answer: counts
    ("Answer: 35", "34", -1.0, "35"),  # wrong
    ("Answer: 34.", "34", -1.0, "34."),  # a trailing period is kept
    ("The result is 34", "34", -1.0, "[INVALID]"),  # no 'Answer:'
    ("Answer: 34" + " and then more" * 30, "34", -1.0, "[INVALID]"),  # outside the last 300 chars
    ("Answer: \\frac12", "1", -1.0, "\\frac{1}{2}"),
])
def test_dapo(response, label, score, pred):
    out = reward("dapo", response, label)
    assert out == {"score": score, "acc": score == 1.0, "pred": pred}


def test_dapo_needs_integer_labels():
    with pytest.raises(ValueError, match="integer labels"):
        get_reward_function("dapo")("Answer: 1/2", "1/2")


def test_dapo_normalisation():
    assert normalize_answer("\\text{5 inches}") == "5"
    assert normalize_answer("\\$1,234") == "1234"
    assert normalize_answer("$\\sqrt2$") == "\\sqrt{2}"
    assert normalize_answer("\\overline{12}") == "12"


def test_dapo_dict_needs_reward_key():
    """DAPO's reward is a dict, as in original slime: the run names its scalar with --reward-key."""
    from slime.rollout.generate import scalar_reward

    out = get_reward_function("dapo")("Answer: 3", "3")
    assert scalar_reward(out, "score") == (1.0, out)
    with pytest.raises(SlimeConfigError, match="--reward-key"):
        scalar_reward(out, None)


# ---------------------------------------------------------------- f1
@pytest.mark.parametrize("response,label,expected", [
    ("Paris", "paris", 1.0),
    ("The Eiffel Tower.", "eiffel tower", 1.0),  # case, punctuation and articles ignored
    ("Paris, France", "Paris", 2 / 3),  # P = 1/2, R = 1
    ("in the city of Paris", "Paris city", 2 * (2 / 4) * 1 / (2 / 4 + 1)),
    ("London", "Paris", 0.0),
    ("yes", "no", 0.0),  # yes/no/noanswer must match exactly
    ("yes it is", "yes", 0.0),
    ("Yes.", "yes", 1.0),
    ("", "Paris", 0.0),
])
def test_f1(response, label, expected):
    assert reward("f1", response, label) == pytest.approx(expected)


def test_f1_score_parts():
    assert f1_score("x b c d", "b c") == (pytest.approx(2 / 3), 0.5, 1.0)
    assert f1_score("a b c d", "b c")[0] == pytest.approx(0.8)  # "a" is an article
    assert f1_score(None, "x") == (0.0, 0.0, 0.0)


# ---------------------------------------------------------------- gpqa
CHOICES = {"choices": ["mitochondria", "nucleus", "ribosome", "golgi apparatus"]}


@pytest.mark.parametrize("response,label,metadata,expected", [
    ("The answer is B", "B", {}, 1.0),
    ("Answer: b", "B", {}, 1.0),
    ("<think>maybe the answer is A</think>Final answer: C", "C", {}, 1.0),  # after </think>
    ("I am sure B is correct", "B", {}, 1.0),
    ("Between (A) and (D), I pick (D).", "D", {}, 1.0),  # the last standalone valid letter
    ("The answer is B", 1, CHOICES, 1.0),  # an integer label indexes the letters
    ("The answer is B", "nucleus", CHOICES, 1.0),  # a label that is a choice's text
    ("The answer is A", "A", {"correct_letter": "b"}, 0.0),  # correct_letter wins over the label
    ("The answer is C", "B", {}, 0.0),  # wrong
    ("The answer is clearly B", "B", {}, 0.0),  # original slime's rule reads C from "clearly"
    ("It is the Nucleus.", "nucleus", CHOICES, 1.0),  # no letter: the correct text is in the response
    ("My pick: mitochondria", 2, CHOICES, 0.0),  # no letter, and the text is another choice's
    ("I cannot tell", "B", {}, 0.0),  # no letter, no text
    # original slime's text fallback: a one-letter label matches any response holding that letter
    # as a word part ("b" in "be"), even a letter out of play
    ("It must be the mitochondria", "B", CHOICES, 1.0),
    ("The answer is E", "E", CHOICES, 1.0),
    ("", "B", {}, 0.0),
])
def test_gpqa(response, label, metadata, expected):
    assert reward("gpqa", response, label, metadata) == expected


# ---------------------------------------------------------------- boxed_ prefix, random, math
@pytest.mark.parametrize("name,response,label,expected", [
    ("boxed_f1", "Let me think about Paris, France... \\boxed{Paris}", "Paris", 1.0),
    ("boxed_f1", "Paris", "Paris", 0.0),  # no boxed answer: graded as ""
    ("boxed_gpqa", "Option A looks wrong. \\boxed{B}", "B", 1.0),
    ("boxed_exact", "so \\boxed{yes}", "yes", 1.0),
    ("boxed_math", "so \\boxed{7}", "7", 1.0),
    ("boxed_math", "the answer is 7", "7", 0.0),  # math needs the box with the prefix
    ("math", "the answer is 7", "7", 1.0),  # this project's math reads the last answer anyway
])
def test_boxed_prefix(name, response, label, expected):
    assert reward(name, response, label) == expected


def test_boxed_dapo():
    assert reward("boxed_dapo", "\\boxed{Answer: 12}", "12")["score"] == 1.0
    assert reward("boxed_dapo", "Answer: 12", "12") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}


def test_random_is_a_coin():
    rewards = {reward("random", "anything", "x") for _ in range(64)}
    assert rewards == {0.0, 1.0}
    assert reward("boxed_random", "", None) in (0.0, 1.0)


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown --rm-type 'boxed_nope'"):
        get_reward_function("boxed_nope")


def test_names_reexport():
    names = importlib.import_module("slime.utils.reward_names")
    assert names.RM_TYPES is RM_TYPES and names.UNAVAILABLE_RM_TYPES is UNAVAILABLE_RM_TYPES
