"""Original slime's built-in functions by the dotted paths its launch scripts pass
(slime.utils.slime_paths): every alias resolves, to a target with the signature the flag expects
here, or is refused with one line naming the flag, the path and the reason; aliased functions run
with this project's semantics (the nonzero-std filter through a real rollout)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from types import SimpleNamespace

import pytest

from slime.rollout import api
from slime.rollout.filters import as_filter_output
from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError
from slime.utils.hooks import load_function
from slime.utils.slime_paths import ALIASES, check_args

FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
SFT = "slime.rollout.sft_rollout.generate_rollout"

# every slime.* dotted path original slime's scripts, examples and docs pass as a flag value
ORIGINAL_FLAG_VALUES = {
    "--dynamic-sampling-filter-path": [FILTER, FILTER + "_with_fallback"],
    "--rollout-function-path": [SFT, "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
                                "slime.rollout.sleep_rollout.sleep", "slime.rollout.sglang_rollout.generate_rollout"],
    "--custom-rm-path": ["slime.rollout.on_policy_distillation.reward_func"],
    "--custom-reward-post-process-path": ["slime.rollout.on_policy_distillation.post_process_rewards"],
    "--custom-generate-function-path": ["slime.rollout.sglang_rollout.generate",
                                        "slime.rollout.sglang_streaming_rollout.generate_streaming"],
    "--data-source-path": ["slime.rollout.data_source.RolloutDataSourceWithBuffer"],
    "--buffer-filter-path": ["slime.rollout.data_source.pop_first"],
}


def _params(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]


# what each flag calls here (docs/custom_rollout.md)
SIGNATURES = {
    "--dynamic-sampling-filter-path": lambda fn: _params(fn)[:2] == ["args", "samples"],
    "--rollout-function-path": lambda fn: (_params(fn) == ["args", "rollout_id", "data_source", "evaluation"]
                                           and inspect.signature(fn).parameters["evaluation"].default is False),
    "--custom-generate-function-path": lambda fn: (inspect.iscoroutinefunction(fn)
                                                   and _params(fn) == ["args", "sample", "sampling_params"]),
    "--buffer-filter-path": lambda fn: _params(fn) == ["args", "buffer", "num_groups"],
    "--data-source-path": lambda cls: (inspect.isclass(cls) and all(
        hasattr(cls, m) for m in ("get_samples", "add_samples", "state_dict", "load_state_dict"))
        and all(p.default is not p.empty for p in list(inspect.signature(cls).parameters.values())[1:])),
}


def test_every_original_flag_value_has_an_alias_for_its_flag():
    for flag, paths in ORIGINAL_FLAG_VALUES.items():
        for path in paths:
            assert path in ALIASES and ALIASES[path].flag == flag, path


@pytest.mark.parametrize("path", sorted(ALIASES))
def test_every_alias_resolves_or_is_refused_in_one_line(path):
    alias = ALIASES[path]
    if alias.target is None:
        assert alias.reason and not alias.note
        with pytest.raises(SlimeConfigError) as e:
            load_function(path, alias.flag)
        assert str(e.value) == f"{alias.flag} {path}: {alias.reason}" and "\n" not in str(e.value)
        return
    fn = load_function(path, alias.flag)
    assert callable(fn) and fn is load_function(alias.target, alias.flag)
    assert alias.target.startswith(("slime.rollout.", "slime.data.")) and not alias.reason
    assert SIGNATURES[alias.flag](fn), f"{path} -> {alias.target}: not the {alias.flag} signature"


def test_fully_async_is_refused_pointing_at_the_flag():
    with pytest.raises(SlimeConfigError, match="pass --fully-async to train_async.py"):
        load_function("slime.rollout.fully_async_rollout.generate_rollout_fully_async", "--rollout-function-path")


def test_an_alias_given_to_another_flag_is_refused():
    with pytest.raises(SlimeConfigError, match=f"--custom-rm-path {FILTER}: .* a --dynamic-sampling-filter-path "):
        load_function(FILTER, "--custom-rm-path")


def test_resolution_is_logged(caplog):
    load_function.cache_clear()
    with caplog.at_level(logging.INFO, logger="slime.utils.hooks"):
        load_function(FILTER, "--dynamic-sampling-filter-path")
        load_function(FILTER + "_with_fallback", "--dynamic-sampling-filter-path")
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"--dynamic-sampling-filter-path {FILTER}: original slime's path, resolved to " \
           "slime.rollout.filters.check_reward_nonzero_std" in infos
    assert len(warnings) == 1 and "--dynamic-sampling-max-rounds" in warnings[0]


def test_other_original_paths_fail_with_a_hint():
    with pytest.raises(SlimeConfigError, match="--custom-rm-path slime.rollout.rm_hub.remote_rm: cannot import .*"
                                               "coming_from_slime.md"):
        load_function("slime.rollout.rm_hub.remote_rm", "--custom-rm-path")


# ---------------------------------------------------------------- the aliases run with this project's semantics
def _group(*rewards, failed=()):
    return [Sample(reward=r, status=SampleStatus.FAILED if i in failed else SampleStatus.COMPLETED)
            for i, r in enumerate(rewards)]


def test_nonzero_std_filter_keeps_and_drops_groups():
    keep = load_function(FILTER, "--dynamic-sampling-filter-path")
    args = SimpleNamespace(reward_key=None)
    assert as_filter_output(keep(args, _group(1.0, 0.0, 1.0, 1.0))).keep
    for group in (_group(1.0, 1.0, 1.0, 1.0), _group(0.0, 0.0), _group(1.0, 0.0, failed={1})):
        out = as_filter_output(keep(args, group))
        assert not out.keep and out.reason == "zero_std"


def test_nonzero_std_filter_and_generate_aliases_through_a_rollout(tiny_model_dir, tmp_path):
    """Original slime's filter and generate paths drive a real rollout on scripted engines: of two
    prompts, the group whose answers differ is kept, the all-correct one dropped."""
    from slime.rollout.generate import sample_seed
    from slime.rollout.manager import RolloutManager
    from tests.helpers.args import make_args
    from tests.helpers.rollout import ScriptedFleet

    rows = '{"input": "same answers", "label": "yes"}\n{"input": "mixed answers", "label": "yes"}\n'
    args = make_args(tiny_model_dir, tmp_path, "--n-samples-per-prompt", 2, "--over-sampling-batch-size", 2,
                     "--global-batch-size", 2, "--dynamic-sampling-max-rounds", 1, "--rm-type", "exact",
                     "--label-key", "label", "--dynamic-sampling-filter-path", FILTER,
                     "--custom-generate-function-path", "slime.rollout.sglang_rollout.generate", data=rows)
    index_of_seed = {sample_seed(args.seed, 0, i): i for i in range(4)}  # samples 0, 1: prompt 0; 2, 3: prompt 1

    def answer(payload):  # prompt 0: right twice; prompt 1: right, then wrong
        return ("no" if index_of_seed[payload["sampling_params"]["sampling_seed"]] == 3 else "yes"), [5, 6], "stop", None

    fleet = ScriptedFleet(answer)
    m = RolloutManager(args, fleet=fleet)
    m.init()
    try:
        rollout = m.sampler.sample(0)
    finally:
        m.sampler.stop()
    assert len(fleet.payloads) == 4
    assert [s.label for s in rollout.samples] == ["yes", "yes"] and [s.index for s in rollout.samples] == [2, 3]
    assert sorted(s.response for s in rollout.samples) == ["no", "yes"]
    assert sorted(s.reward for s in rollout.samples) == [0.0, 1.0]
    assert all(s.response_length == 2 and s.loss_mask == [1, 1] for s in rollout.samples)
    assert rollout.metrics["rollout/dynamic_filter/drop_zero_std"] == 1.0


def test_generate_alias_continues_the_sample_through_the_context():
    from tests.helpers.rollout import ScriptedFleet

    generate = load_function("slime.rollout.sglang_rollout.generate", "--custom-generate-function-path")
    fleet = ScriptedFleet([("hi", [7, 8, 9], "length", None)])
    api.set_context(api.RolloutContext(SimpleNamespace(), None, fleet, ""))
    try:
        s = asyncio.run(generate(SimpleNamespace(), Sample(tokens=[1, 2]), {"max_new_tokens": 3}))
    finally:
        api.set_context(None)
    assert s.tokens == [1, 2, 7, 8, 9] and s.response == "hi" and s.response_length == 3
    assert s.status == SampleStatus.TRUNCATED and fleet.payloads[0]["input_ids"] == [1, 2]


def test_pop_first_alias_in_the_built_in_data_source():
    from slime.data.dataset import Prompt
    from slime.data.source import RolloutDataSource

    args = SimpleNamespace(rollout_shuffle=False, rollout_seed=0, n_samples_per_prompt=1,
                           buffer_filter_path="slime.rollout.data_source.pop_first")
    source = RolloutDataSource(args, [Prompt(prompt="p", input_ids=[1], label=i) for i in range(4)])
    given = [[Sample(label=f"b{i}")] for i in range(3)]
    source.add_samples(given)
    assert [g[0].label for g in source.get_samples(2)] == ["b0", "b1"]
    assert [g[0].label for g in source.get_samples(2)] == ["b2", 0]


def test_sft_alias_needs_sft_loss():
    rollout = load_function(SFT, "--rollout-function-path")
    source = SimpleNamespace(get_samples=lambda n: [[Sample(label=i)] for i in range(n)])
    args = SimpleNamespace(loss_type="sft_loss", rollout_batch_size=3, rollout_function_path=SFT)
    assert [g[0].label for g in rollout(args, 0, source)] == [0, 1, 2]
    check_args(args)
    args.loss_type = "policy_loss"
    for call in (lambda: rollout(args, 0, source), lambda: check_args(args)):
        with pytest.raises(SlimeConfigError, match=f"--rollout-function-path {SFT}: .*--loss-type sft_loss"):
            call()


def test_sleep_alias_sleeps_until_stopped(monkeypatch, caplog):
    import slime.rollout.upstream_compat as compat

    naps = []

    def nap(seconds):
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(compat.time, "sleep", nap)
    sleep = load_function("slime.rollout.sleep_rollout.sleep", "--rollout-function-path")
    with caplog.at_level(logging.INFO, logger="slime.rollout.upstream_compat"), pytest.raises(KeyboardInterrupt):
        sleep(SimpleNamespace(), 3, None)
    assert naps == [3600, 3600] and "rollout 3 sleeping for 1 hour(s)" in caplog.text
