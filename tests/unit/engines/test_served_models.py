"""--sglang-config: the served models read from slime's YAML (the policy and frozen ones), the args
each model's engines see, the devices counted and placed, and one line for every bad input."""

from __future__ import annotations

import shutil
import textwrap

import pytest
import ray

from slime.engines.kinds import engine_kind
from slime.engines.served_models import model_args
from slime.ray import placement
from slime.rollout import api
from slime.utils.errors import SlimeConfigError
from tests.helpers.args import make_args


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """A frozen model: the tiny model under another path."""
    d = tmp_path_factory.mktemp("teacher") / "model"
    shutil.copytree(tiny_model_dir, d)
    return str(d)


def _config(tmp_path, text: str, name: str = "served.yaml") -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def _two_models(tmp_path, teacher_dir, teacher_extra: str = "") -> str:
    return _config(tmp_path, f"""
        sglang:
          - name: policy
            server_groups:
              - worker_type: regular
                num_gpus: 2
          - name: teacher
            model_path: {teacher_dir}
            update_weights: false
            server_groups:
              - worker_type: regular
                num_gpus: 1
                overrides: {{max_running_requests: 7}}
        {teacher_extra}""")


def test_policy_and_frozen_model_from_slimes_yaml(tiny_model_dir, teacher_dir, tmp_path):
    cfg = _two_models(tmp_path, teacher_dir)
    args = make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg, "--sglang-max-running-requests", 5)
    # the policy: two one-device engines; --rollout-num-gpus counts every served model's devices (as slime)
    assert (args.policy_model_name, args.num_engines, args.rollout_num_gpus_per_engine) == ("policy", 2, 1)
    assert args.rollout_num_gpus == 3
    (teacher,) = args.served_models
    assert (teacher.name, teacher.model_path, teacher.engine, teacher.num_engines, teacher.update_weights) == (
        "teacher", teacher_dir, "native", 1, False)
    view = model_args(args, teacher)
    assert view.hf_checkpoint == teacher_dir and view.num_engines == 1 and view.lora_sync is None
    # its overrides win over the run's --sglang-* flags; the policy keeps the run's
    assert view.sglang_args["max_running_requests"] == 7 and args.sglang_args["max_running_requests"] == "5"
    cmd = engine_kind(view).command(view, 0, "127.0.0.1", 30000)
    assert cmd[cmd.index("--model-path") + 1] == teacher_dir
    assert cmd[cmd.index("--max-running-requests") + 1] == "7"
    assert args.rollout_num_gpus == 3 and not hasattr(view, "_frozen")  # the run's args are untouched


def test_without_the_flag_one_policy_named_actor(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, "--rollout-num-gpus", 2)
    assert (args.served_models, args.policy_model_name, args.num_engines) == ((), "actor", 2)


def test_update_weights_is_inferred_from_the_checkpoint(tiny_model_dir, teacher_dir, tmp_path):
    cfg = _config(tmp_path, f"""
        sglang:
          - name: judge
            model_path: {teacher_dir}
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
          - name: actor
            model_path: {tiny_model_dir}
            num_gpus_per_engine: 1
            engine_groups: [{{worker_type: regular, num_gpus: 1}}]
        """)
    args = make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg, "--rollout-num-gpus", 2)
    assert args.policy_model_name == "actor" and [m.name for m in args.served_models] == ["judge"]


def test_placement_gives_frozen_models_the_devices_after_the_policys(tiny_model_dir, teacher_dir, tmp_path):
    cfg = _config(tmp_path, f"""
        sglang:
          - name: actor
            server_groups: [{{worker_type: regular, num_gpus: 2}}]
          - name: teacher
            model_path: {teacher_dir}
            update_weights: false
            server_groups: [{{worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}}]
          - name: judge
            model_path: {teacher_dir}
            update_weights: false
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
        """)
    args = make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg)
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        p = placement.create(args)
        # 1 train rank, then the policy's 2 engines, the teacher's one 2-device engine, the judge's engine
        assert (p.actor_bundles, p.engine_bundles) == ([0], [1, 2])
        assert p.model_bundles == {"teacher": [3], "judge": [5]}
        assert len(p.pg.bundle_specs) == 6
        ray.util.remove_placement_group(p.pg)
    finally:
        ray.shutdown()


def test_context_reaches_a_served_model_by_name(tiny_model_dir, tmp_path):
    class Pool:
        router_url = "http://127.0.0.1:9/"

    args = make_args(tiny_model_dir, tmp_path)
    api.set_context(api.RolloutContext(args, None, None, "", models={"teacher": Pool()}))
    try:
        assert api.get_model_url(args, "teacher") == "http://127.0.0.1:9/generate"
        assert api.get_model_url(args, "teacher", "/v1/chat/completions") == "http://127.0.0.1:9/v1/chat/completions"
        with pytest.raises(KeyError, match=r"no served model named 'judge'; this run serves \['teacher'\]"):
            api.context().model("judge")
    finally:
        api.set_context(None)


@pytest.mark.parametrize("body, message", [
    ("sglang: []", r"sglang: must be a non-empty list of models"),
    ("models: []", r"sglang: missing"),
    ("sglang:\n  - name: a\n    server_group: []",
     r"sglang\[0\].server_group: unknown field \(did you mean server_groups\?\)"),
    ("sglang:\n  - server_groups: [{worker_type: regular, num_gpus: 1}]", r"sglang\[0\].name: required"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: prefill, num_gpus: 1}]",
     r"sglang\[0\].server_groups\[0\].worker_type: prefill is not served by this build"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 0}]",
     r"sglang\[0\].server_groups\[0\].num_gpus: must be an integer >= 1, got 0"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 3, num_gpus_per_engine: 2}]",
     r"sglang\[0\].server_groups\[0\].num_gpus: 3 is not a multiple of num_gpus_per_engine 2"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 1}]\n"
     "  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 1}]",
     r"sglang\[1\].name: 'a' is used twice"),
    ("sglang:\n  - name: a\n    update_weights: false\n    server_groups: [{worker_type: regular, num_gpus: 1}]",
     r"sglang: no model takes the trainer's weights"),
    ("sglang:\n  - name: a\n    engine: tgi\n    server_groups: [{worker_type: regular, num_gpus: 1}]",
     r"sglang\[0\].engine: 'tgi' is not an engine kind"),
    ("sglang:\n  - name: a\n    server_groups: [{worker_type: regular, num_gpus: 1, overrides: {tp_size: 2}}]",
     r"sglang\[0\].server_groups\[0\].overrides.tp_size: is set by slime"),
    ("sglang:\n  - name: a\n    server_groups:\n      - {worker_type: regular, num_gpus: 1}\n"
     "      - {worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}",
     r"sglang\[0\].server_groups\[1\]: differs from the model's first group"),
    ("sglang: [\n", r"not valid YAML \(line \d+\)"),
])
def test_bad_config_is_one_line_naming_the_file_and_field(tiny_model_dir, tmp_path, body, message):
    cfg = _config(tmp_path, body)
    with pytest.raises(SlimeConfigError, match=rf"^--sglang-config {cfg}: {message}") as ei:
        make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg)
    assert "\n" not in str(ei.value)


def test_bad_combinations_with_flags(tiny_model_dir, teacher_dir, tmp_path):
    cfg = _two_models(tmp_path, teacher_dir)
    with pytest.raises(SlimeConfigError, match=r"--rollout-num-gpus 2: --sglang-config .* serves 3 devices "
                                               r"\(policy 2, teacher 1\)"):
        make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg, "--rollout-num-gpus", 2)
    with pytest.raises(SlimeConfigError, match=r"^--sglang-config: file .*missing.yaml does not exist$"):
        make_args(tiny_model_dir, tmp_path, "--sglang-config", str(tmp_path / "missing.yaml"))
    with pytest.raises(SlimeConfigError, match=r"starts a router per served model"):
        make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg, "--sglang-router-ip", "127.0.0.1",
                  "--sglang-router-port", 30000)
    missing = _config(tmp_path, f"""
        sglang:
          - name: actor
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
          - name: teacher
            model_path: {tmp_path / 'nowhere'}
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
        """, "missing_model.yaml")
    with pytest.raises(SlimeConfigError, match=r"sglang\[1\].model_path: .*nowhere is not a Hugging Face model "
                                               r"directory \(no config.json\)"):
        make_args(tiny_model_dir, tmp_path, "--sglang-config", missing)
    wrong = _config(tmp_path, f"""
        sglang:
          - name: actor
            model_path: {teacher_dir}
            update_weights: true
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
        """, "wrong_policy.yaml")
    with pytest.raises(SlimeConfigError, match=r"sglang\[0\].model_path: .* is not --hf-checkpoint"):
        make_args(tiny_model_dir, tmp_path, "--sglang-config", wrong)
    with pytest.raises(SlimeConfigError, match=r"--sglang-config serves models, which --debug-train-only"):
        make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg, "--debug-train-only",
                  "--load-debug-rollout-data", str(tmp_path / "x.pt"))


def test_pool_sends_routed_expert_requests_to_the_engines_itself():
    """sglang-router 0.3.x drops request fields it does not know, return_routed_experts among them:
    with --use-rollout-routing-replay the pool asks an admitted engine directly (the least busy)."""
    import asyncio

    from slime.engines.fleet import EnginePool

    pool = EnginePool(["http://127.0.0.1:1", "http://127.0.0.1:2"], timeout=5, router_url="http://127.0.0.1:3",
                      routed_experts=True)
    calls = []

    class Fake:
        def __init__(self, name):
            self.name = name

        async def generate(self, payload):
            calls.append((self.name, payload.get("return_routed_experts")))
            await asyncio.sleep(0.01)
            return {"by": self.name}

        async def close(self):
            pass

    pool.router = Fake("router")
    pool.engines = {u: Fake(u[-1]) for u in pool.urls}

    async def main():
        both = await asyncio.gather(pool.generate({"input_ids": [1]}), pool.generate({"input_ids": [2]}))
        pool.mark_down("http://127.0.0.1:1")
        third = await pool.generate({"input_ids": [3]})
        plain = await pool.generate({"input_ids": [4], "return_routed_experts": False})
        return both, third, plain

    both, third, plain = asyncio.run(main())
    assert sorted(r["by"] for r in both) == ["1", "2"]  # in flight at once: one each
    assert third["by"] == "2" and plain["by"] == "router"  # engine 1 is down; no routing asked: the router
    assert calls[-1] == ("router", False) and all(flag for name, flag in calls[:-1])
