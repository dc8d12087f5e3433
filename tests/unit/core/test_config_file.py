"""`--config run.yaml` (slime.config_file): flags from a YAML file, the command line winning;
`--print-config`; `--apply-chat-template-kwargs`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from slime.arguments import parse_args, parse_flags
from slime.data.source import make_data_source
from slime.rollout.multiturn import env_message_tokens
from slime.utils.errors import SlimeConfigError

ROOT = Path(__file__).resolve().parents[3]


def write(path, text):
    path.write_text(text)
    return str(path)


def flags(tmp_path, text, *argv):
    return parse_flags(["--config", write(tmp_path / "run.yaml", text), "--hf-checkpoint", "m", *argv])


def error(tmp_path, text, *argv) -> str:
    with pytest.raises(SlimeConfigError) as e:
        flags(tmp_path, text, *argv)
    return str(e.value)


@pytest.fixture
def run_files(tiny_model_dir, tmp_path):
    data = write(tmp_path / "data.jsonl", "\n".join(json.dumps({"input": f"q{i}", "label": str(i)})
                                                     for i in range(4)) + "\n")
    return ["--hf-checkpoint", tiny_model_dir, "--prompt-data", data, "--output-dir", str(tmp_path / "out")]


def test_file_values_and_command_line_precedence(tmp_path):
    text = ("rollout-batch-size: 4\n"
            "rollout-stop: [A, B]\n"
            "use-kl-loss: true\n"
            "use-tensorboard: false\n"
            "disable-rewards-normalization: true\n"
            "lr: 1e-6\n")
    a = flags(tmp_path, text)
    assert (a.rollout_batch_size, a.rollout_stop, a.use_kl_loss, a.use_tensorboard) == (4, ["A", "B"], True, False)
    assert (a.rewards_normalization, a.lr) == (False, 1e-6)
    b = flags(tmp_path, text, "--rollout-batch-size", "3", "--rollout-stop", "C", "--use-tensorboard")
    assert (b.rollout_batch_size, b.rollout_stop, b.use_kl_loss, b.use_tensorboard) == (3, ["C"], True, True)
    # a switch set in the file stays set: only a flag with a negative form can be turned off
    off = flags(tmp_path, "use-tensorboard: true\nrollout-batch-size: 1\n", "--no-use-tensorboard")
    assert off.use_tensorboard is False
    # false and null leave a flag out
    c = flags(tmp_path, "use-kl-loss: false\nrollout-stop: null\nrollout-batch-size: 1\n")
    assert (c.use_kl_loss, c.rollout_stop) == (False, None)


def test_names_with_underscores_hyphens_or_dashes(tmp_path):
    a = flags(tmp_path, "rollout_batch_size: 2\nn-samples-per-prompt: 3\n--num_rollout: 5\n")
    assert (a.rollout_batch_size, a.n_samples_per_prompt, a.num_rollout) == (2, 3, 5)


def test_pass_through_keys_reach_sglang_and_vllm_args(tmp_path):
    text = ("rollout-batch-size: 1\n"
            "sglang-mem-fraction-static: 0.8\n"
            "sglang_cuda_graph_bs: [1, 2, 4]\n"
            "sglang-enable-dp-attention: true\n"
            "sglang-disable-radix-cache: false\n"
            "sglang-context-length: 4096\n"
            "vllm-max-num-seqs: 8\n")
    a = flags(tmp_path, text, "--sglang-context-length", "2048")
    assert a.sglang_args == {"mem_fraction_static": "0.8", "cuda_graph_bs": ["1", "2", "4"],
                             "enable_dp_attention": True, "context_length": "2048"}
    assert a.vllm_args == {"max_num_seqs": "8"}


def test_unknown_key_names_the_line_and_the_flag_meant(tmp_path):
    f = tmp_path / "run.yaml"
    assert error(tmp_path, "lr: 1e-6\nrollout-batchsize: 4\n") == \
        f"{f}:2: unknown key 'rollout-batchsize' (did you mean --rollout-batch-size?)"
    assert error(tmp_path, "spek: 1\n") == f"{f}:1: unknown key 'spek'"


def test_malformed_yaml_and_bad_values_are_one_line(tmp_path):
    f = tmp_path / "run.yaml"
    assert error(tmp_path, "rollout-batch-size: 4\n  lr: 1\n") == \
        f"{f}:2: malformed YAML (mapping values are not allowed here)"
    assert error(tmp_path, "lr: 1\nrollout-stop: [A\n") == \
        f"{f}:3: malformed YAML (expected ',' or ']', but got '<stream end>')"
    assert error(tmp_path, "- lr\n- 1\n") == \
        f"{f}:1: the top level must be a mapping of flag names to values, got a list"
    assert error(tmp_path, "lr\n") == \
        f"{f}:1: the top level must be a mapping of flag names to values, got a single value"
    assert error(tmp_path, "lr: 1\nrollout-batch-size: four\n") == \
        f"{f}:2: --rollout-batch-size: invalid int value 'four'"
    assert error(tmp_path, "kl-loss-type: k9\n") == \
        f"{f}:1: --kl-loss-type: invalid choice 'k9' (choose from k1, k2, k3, low_var_kl)"
    assert error(tmp_path, "colocate: 1\n") == f"{f}:1: --colocate is a switch: give true or false, got 1"
    assert error(tmp_path, "lr: [1, 2]\n") == f"{f}:1: --lr takes one value, got a list"
    assert error(tmp_path, "lr: 1\nrollout_batch_size: 1\nrollout-batch-size: 2\n") == \
        f"{f}:3: --rollout-batch-size is given twice (first on line 2)"
    assert error(tmp_path, "config: other.yaml\n") == \
        f"{f}:1: --config cannot be set in a config file (give it on the command line)"


def test_config_path_errors(tmp_path):
    with pytest.raises(SlimeConfigError) as e:
        parse_flags(["--config", str(tmp_path / "none.yaml"), "--hf-checkpoint", "m"])
    assert str(e.value) == f"--config: file {tmp_path / 'none.yaml'} does not exist"
    f = write(tmp_path / "a.yaml", "lr: 1\n")
    with pytest.raises(SlimeConfigError) as e:
        parse_flags(["--config", f, "--config=" + f, "--hf-checkpoint", "m"])
    assert str(e.value) == f"--config may be given once, got 2: {f} {f}"


def test_print_config_round_trip(run_files, tmp_path):
    config = write(tmp_path / "run.yaml", yaml.safe_dump({
        "rollout-batch-size": 2, "n_samples_per_prompt": 2, "num-rollout": 1, "rollout-stop": ["</s>", "END"],
        "use-tensorboard": False, "disable-rewards-normalization": True, "lr": 2.5e-6,
        "apply-chat-template": True, "apply-chat-template-kwargs": {"enable_thinking": False},
        "sglang-mem-fraction-static": 0.8, "sglang-cuda-graph-bs": [1, 2]}))
    argv = ["--config", config, *run_files, "--seed", "7"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "train.py", *argv, "--print-config"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for line in ("rollout-batch-size: 2", "seed: 7", "rollout-stop: [</s>, END]", "use-tensorboard: false",
                 "disable-rewards-normalization: true", "lr: 2.5e-06", "colocate: false",
                 "apply-chat-template-kwargs: {enable_thinking: false}", "global-batch-size: null  # resolved: 4",
                 "sglang-mem-fraction-static: '0.8'", "sglang-cuda-graph-bs: ['1', '2']"):
        assert line in lines
    assert not any(line.startswith(("config:", "print-config:", "engine-api-key:")) for line in lines)
    printed = write(tmp_path / "printed.yaml", out.stdout)
    again, first = parse_args(["--config", printed]), parse_args(argv)
    assert {k: v for k, v in vars(again).items() if k != "config"} == \
           {k: v for k, v in vars(first).items() if k != "config"}
    assert (again.apply_chat_template_kwargs, again.sglang_args) == \
           ({"enable_thinking": False}, {"mem_fraction_static": "0.8", "cuda_graph_bs": ["1", "2"]})


def test_print_config_leaves_secrets_out(run_files, capsys):
    key = "a-secret-engine-key-0123456789"
    with pytest.raises(SystemExit) as e:
        parse_args([*run_files, "--rollout-batch-size", "1", "--num-rollout", "1", "--engine-api-key", key,
                    "--wandb-key", "wandb-secret", "--print-config"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert key not in out and "wandb-secret" not in out
    assert out.splitlines()[-1] == "# not printed (secrets): --engine-api-key, --wandb-key"


def test_apply_chat_template_kwargs_flag_errors(run_files):
    base = [*run_files, "--rollout-batch-size", "1", "--num-rollout", "1"]
    for value, why in (("[1]", """must be a JSON object such as '{"enable_thinking": false}', got '[1]'"""),
                       ("{x", "not valid JSON (Expecting property name enclosed in double quotes at column 2): "
                              "'{x'")):
        with pytest.raises(SlimeConfigError) as e:
            parse_args(base + ["--apply-chat-template", "--apply-chat-template-kwargs", value])
        assert str(e.value) == f"argument --apply-chat-template-kwargs: {why}"
    with pytest.raises(SlimeConfigError) as e:
        parse_args(base + ["--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    assert str(e.value) == "--apply-chat-template-kwargs needs --apply-chat-template (its keys go to the chat template)"


TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %} no thinking{% endif %}")


def test_apply_chat_template_kwargs_reach_the_rendered_prompt(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    tok = AutoTokenizer.from_pretrained(model)
    data = write(tmp_path / "data.jsonl", json.dumps({"input": "1 + 1", "label": "2"}) + "\n")
    config = write(tmp_path / "run.yaml", "apply-chat-template: true\n"
                                          "apply-chat-template-kwargs: {enable_thinking: false}\n")
    base = ["--hf-checkpoint", str(model), "--prompt-data", data, "--output-dir", str(tmp_path / "out"),
            "--rollout-batch-size", "1", "--num-rollout", "1"]
    for argv, text in ((["--config", config], "1 + 1 no thinking"),
                       (["--apply-chat-template"], "1 + 1"),
                       (["--config", config, "--apply-chat-template-kwargs", '{"enable_thinking": true}'], "1 + 1")):
        args = parse_args(base + argv)
        ((sample,),) = make_data_source(args, tok).get_samples(1)
        assert sample.tokens == tok(text, add_special_tokens=False)["input_ids"]


def test_env_message_tokens_take_the_template_variables(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}{{ m.content }}" + tok.eos_token + "{% endfor %}"
                         "{% if add_generation_prompt %}>{% if enable_thinking is defined and not enable_thinking %}"
                         " no thinking{% endif %}{% endif %}")
    msgs = [{"role": "tool", "content": "7"}]
    assert env_message_tokens(tok, msgs, chat_template_kwargs={"enable_thinking": False}) == \
        tok("7" + tok.eos_token + "> no thinking", add_special_tokens=False)["input_ids"]
    assert env_message_tokens(tok, msgs) == tok("7" + tok.eos_token + ">", add_special_tokens=False)["input_ids"]
