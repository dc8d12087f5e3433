"""The SGLang backend's command lines without SGLang: `sglang_command` and the --sglang-* checks
against a parser captured from SGLang 0.5.23's ServerArgs, GPU placement (`base_gpu_id`), and
`EngineServer` starting the command (a stand-in `sglang` package serves it with the native
engine). The control calls are in test_sglang_backend.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

import pytest

from slime.engines.control import EngineControl
from slime.engines.sglang import base_gpu_id, check_sglang_args, sglang_command, sglang_parser
from slime.utils.errors import SlimeConfigError
from tests.helpers.args import make_args

# ----------------------------------------------------------------- captured from SGLang 0.5.23


def _captured_add_cli_args(parser: argparse.ArgumentParser) -> None:
    """A subset of SGLang 0.5.23's server flags, registered the way its add_cli_args does
    (aliases, types, store_true switches, list options with nargs '+', choices)."""
    a = parser.add_argument
    a("--model-path", "--model", dest="model_path", type=str, required=True)
    a("--tokenizer-path", type=str, default=None)
    a("--host", type=str, default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    a("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    a("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
    a("--nnodes", type=int, default=1)
    a("--base-gpu-id", type=int, default=0)
    a("--nccl-port", type=int, default=None)
    a("--random-seed", type=int, default=None)
    a("--mem-fraction-static", type=float, default=None)
    a("--enable-memory-saver", action="store_true", default=False)
    a("--max-running-requests", type=int, default=None)
    a("--disable-radix-cache", action="store_true", default=False)
    a("--cuda-graph-bs-decode", type=int, nargs="+", default=None)
    a("--attention-backend", type=str, choices=["triton", "torch_native", "flashinfer", "fa3"], default=None)
    a("--log-level", type=str, default="info")
    a("--context-length", type=int, default=None)
    a("--weight-version", type=str, default="default")
    a("--uvicorn-access-log-exclude-prefixes", type=str, nargs="*", default=None)
    a("--api-key", type=str, default=None)
    a("--dtype", type=str, default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    a("--enable-lora", action="store_true", default=None)
    a("--max-lora-rank", type=int, default=None)
    a("--lora-target-modules", type=str, nargs="*", default=None,
      choices=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
               "gate_up_proj", "all"])
    a("--max-loras-per-batch", type=int, default=8)


@pytest.fixture
def fake_sglang(monkeypatch):
    """Make `from sglang.srt.server_args import ServerArgs` find the captured parser."""
    server_args = types.ModuleType("sglang.srt.server_args")
    server_args.ServerArgs = type("ServerArgs", (), {"add_cli_args": staticmethod(_captured_add_cli_args)})
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", server_args)
    return server_args


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("sgl_data") / "d.jsonl"
    p.write_text(json.dumps({"input": "x"}) + "\n")
    return str(p)


def _args(tiny_model_dir, data_file, *extra):
    return make_args(tiny_model_dir, Path(data_file).parent, "--prompt-data", data_file, "--seed", 7,
                     "--rollout-backend", "sglang", *extra)


def _opt(cmd, flag):
    i = cmd.index(flag)
    return cmd[i + 1]


# ----------------------------------------------------------------- command lines


def test_command_one_engine(fake_sglang, tiny_model_dir, data_file):
    args = _args(tiny_model_dir, data_file)
    cmd = sglang_command(args, rank=0, host="127.0.0.1", port=4321)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert _opt(cmd, "--model-path") == tiny_model_dir
    assert (_opt(cmd, "--host"), _opt(cmd, "--port"), _opt(cmd, "--tp-size")) == ("127.0.0.1", "4321", "1")
    assert (_opt(cmd, "--base-gpu-id"), _opt(cmd, "--random-seed")) == ("0", "7")
    assert 1024 <= int(_opt(cmd, "--nccl-port")) <= 65535 and int(_opt(cmd, "--nccl-port")) != 4321
    assert "--enable-memory-saver" not in cmd and "--mem-fraction-static" not in cmd  # not colocated
    # the whole line parses with SGLang's own parser
    ns = sglang_parser().parse_args(cmd[3:])
    assert (ns.model_path, ns.port, ns.tp_size, ns.base_gpu_id) == (tiny_model_dir, 4321, 1, 0)


def test_command_several_engines_gpu_placement(fake_sglang, tiny_model_dir, data_file):
    # 4 train ranks fill a 4-GPU node; 4 rollout GPUs in engines of 2 take bundles 4 and 6 of the
    # next node: GPUs 0 and 2 there
    args = _args(tiny_model_dir, data_file, "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
                 "--rollout-num-gpus-per-engine", "2", "--rollout-batch-size", "4")
    assert args.num_engines == 2
    cmds = [sglang_command(args, r, "127.0.0.1", 5000 + r) for r in range(2)]
    assert [_opt(c, "--tp-size") for c in cmds] == ["2", "2"]
    assert [_opt(c, "--base-gpu-id") for c in cmds] == ["0", "2"]
    assert [_opt(c, "--random-seed") for c in cmds] == ["7", "8"]
    assert [_opt(c, "--port") for c in cmds] == ["5000", "5001"]
    assert len({_opt(c, "--nccl-port") for c in cmds}) == 2
    assert all(c.count("--tp-size") == 1 and c.count("--base-gpu-id") == 1 for c in cmds)


def test_base_gpu_id_layouts():
    ns = argparse.Namespace
    # one 8-GPU node: 4 train ranks, 4 rollout GPUs as 2 engines of 2 -> GPUs 4 and 6
    a = ns(rollout_num_gpus_per_engine=2, colocate=False, dp_size=4, actor_num_gpus_per_node=4)
    assert [base_gpu_id(a, r, gpus_per_node=8) for r in range(2)] == [4, 6]
    # the same flags without the node's GPU count: nodes of --actor-num-gpus-per-node (4) GPUs
    assert [base_gpu_id(a, r) for r in range(2)] == [0, 2]
    # one train rank + one engine on a 2-GPU node: the engine gets GPU 1, not the trainer's GPU 0
    a = ns(rollout_num_gpus_per_engine=1, colocate=False, dp_size=1, actor_num_gpus_per_node=1)
    assert base_gpu_id(a, 0, gpus_per_node=2) == 1
    # colocated on 8 GPUs, engines of 4 -> GPUs 0 and 4 (the train ranks' own devices)
    a = ns(rollout_num_gpus_per_engine=4, colocate=True, dp_size=8, actor_num_gpus_per_node=8)
    assert [base_gpu_id(a, r) for r in range(2)] == [0, 4]
    # an engine that would straddle two nodes is refused, naming the flag
    a = ns(rollout_num_gpus_per_engine=4, colocate=False, dp_size=2, actor_num_gpus_per_node=8)
    with pytest.raises(SlimeConfigError, match="span two nodes .*--rollout-num-gpus-per-engine"):
        base_gpu_id(a, 1)  # bundle 6 -> GPUs 6..9
    # an actor holding a share of its bundle's GPU: Ray names the GPU, the formula is not used
    a = ns(rollout_num_gpus_per_engine=2, colocate=False, dp_size=1, actor_num_gpus_per_node=1)
    assert base_gpu_id(a, 0, gpus_per_node=8, ray_gpu_ids=["5"]) == 5
    assert base_gpu_id(a, 0, ray_gpu_ids=[5], visible_devices="1,3,5,7") == 2
    with pytest.raises(SlimeConfigError, match="NOSET_CUDA_VISIBLE_DEVICES"):
        base_gpu_id(a, 0, ray_gpu_ids=[5], visible_devices="5")  # Ray narrowed it to one GPU; TP 2 needs two
    with pytest.raises(SlimeConfigError, match="hides"):
        base_gpu_id(a, 0, ray_gpu_ids=[5], visible_devices="0,1")


def test_colocated_sglang_is_refused_at_parse_time(fake_sglang, tiny_model_dir, data_file):
    with pytest.raises(SlimeConfigError, match="colocated SGLang .* is not implemented, so drop --colocate"):
        _args(tiny_model_dir, data_file, "--colocate", "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "2")
    seeded = sglang_command(_args(tiny_model_dir, data_file, "--sglang-random-seed", "3"), 0, "127.0.0.1", 4000)
    assert seeded.count("--random-seed") == 1 and _opt(seeded, "--random-seed") == "3"  # the user's replaces slime's


def test_forwarding_values_bare_flags_equals_form_and_lists(fake_sglang, tiny_model_dir, data_file):
    args = _args(tiny_model_dir, data_file, "--sglang-max-running-requests", "64", "--sglang-disable-radix-cache",
                 "--sglang-attention-backend=triton", "--sglang-cuda-graph-bs-decode", "1 2 4",
                 "--sglang-context-length=2048", "--sglang-uvicorn-access-log-exclude-prefixes")
    assert args.sglang_args == {"max_running_requests": "64", "disable_radix_cache": True,
                                "attention_backend": "triton", "cuda_graph_bs_decode": "1 2 4",
                                "context_length": "2048", "uvicorn_access_log_exclude_prefixes": True}
    cmd = sglang_command(args, 0, "127.0.0.1", 4000)
    tail = cmd[cmd.index("--max-running-requests"):]
    assert tail == ["--max-running-requests", "64", "--disable-radix-cache", "--attention-backend", "triton",
                    "--cuda-graph-bs-decode", "1", "2", "4", "--context-length", "2048",
                    "--uvicorn-access-log-exclude-prefixes"]  # nargs '*': bare is fine
    ns = sglang_parser().parse_args(cmd[3:])
    assert (ns.max_running_requests, ns.disable_radix_cache, ns.cuda_graph_bs_decode) == (64, True, [1, 2, 4])
    assert ns.uvicorn_access_log_exclude_prefixes == []


def test_lora_adapters_flags(fake_sglang, tiny_model_dir, data_file):
    """--lora-rank with --lora-sync adapter: SGLang serves adapters up to that rank on every linear
    layer, one adapter per batch; a --sglang-* value replaces slime's; merged sync adds nothing."""
    args = _args(tiny_model_dir, data_file, "--lora-rank", "12", "--lora-sync", "adapter")
    cmd = sglang_command(args, 0, "127.0.0.1", 4000)
    i = cmd.index("--enable-lora")
    assert cmd[i:] == ["--enable-lora", "--max-lora-rank", "12", "--lora-target-modules", "all",
                       "--max-loras-per-batch", "1"]
    ns = sglang_parser().parse_args(cmd[3:])
    assert (ns.enable_lora, ns.max_lora_rank, ns.lora_target_modules, ns.max_loras_per_batch) == (True, 12, ["all"], 1)

    args = _args(tiny_model_dir, data_file, "--sglang-max-loras-per-batch", "4",
                 "--sglang-lora-target-modules", "q_proj v_proj", "--lora-rank", "8")  # --lora-sync auto: adapter
    cmd = sglang_command(args, 0, "127.0.0.1", 4000)
    assert cmd.count("--max-loras-per-batch") == 1 and _opt(cmd, "--max-loras-per-batch") == "4"
    assert cmd.count("--lora-target-modules") == 1 and sglang_parser().parse_args(cmd[3:]).lora_target_modules == [
        "q_proj", "v_proj"]
    assert _opt(cmd, "--max-lora-rank") == "8" and cmd.count("--enable-lora") == 1

    for flags in (["--lora-rank", "8", "--lora-sync", "merged"], []):
        cmd = sglang_command(_args(tiny_model_dir, data_file, *flags), 0, "127.0.0.1", 4000)
        assert not [f for f in cmd if "lora" in f]


@pytest.mark.parametrize("flags, match", [
    (["--sglang-port", "1"], r"--sglang-port is set by slime"),
    (["--sglang-model-path", "/x"], r"--sglang-model-path is set by slime .*--hf-checkpoint"),
    (["--sglang-model", "/x"], r"--sglang-model is set by slime .*--hf-checkpoint"),  # an alias
    (["--sglang-tensor-parallel-size", "2"], r"--sglang-tensor-parallel-size .*--rollout-num-gpus-per-engine"),
    (["--sglang-tp-size", "2"], r"--sglang-tp-size .*--rollout-num-gpus-per-engine"),
    (["--sglang-base-gpu-id", "3"], r"--sglang-base-gpu-id is set by slime"),
    (["--sglang-nccl-port", "3"], r"--sglang-nccl-port is set by slime"),
    (["--sglang-host", "0.0.0.0"], r"--sglang-host is set by slime"),
    (["--sglang-dp-size", "2"], r"--sglang-dp-size 2: .*--rollout-num-gpus"),
    (["--sglang-max-runing-requests", "2"], r"--sglang-max-runing-requests: .*no flag --max-runing-requests "
                                            r"\(did you mean --sglang-max-running-requests\?\)"),
    (["--sglang-max-running-requests"], r"--sglang-max-running-requests needs a value"),
    (["--sglang-disable-radix-cache=1"], r"--sglang-disable-radix-cache is a switch and takes no value"),
    (["--sglang-mem-fraction-static", "lots"], r"--mem-fraction-static: invalid float value: 'lots'"),
    (["--sglang-attention-backend", "magic"], r"--attention-backend: invalid choice: 'magic'"),
])
def test_bad_sglang_flags_name_the_flag(fake_sglang, tiny_model_dir, data_file, flags, match):
    with pytest.raises(SlimeConfigError, match=match):  # at parse time (check_sglang_args), before any engine
        sglang_command(_args(tiny_model_dir, data_file, *flags), 0, "127.0.0.1", 4000)


def test_one_valued_device_flags_pass(fake_sglang, tiny_model_dir, data_file):
    args = _args(tiny_model_dir, data_file, "--sglang-pp-size", "1")
    cmd = sglang_command(args, 0, "127.0.0.1", 4000)
    assert _opt(cmd, "--pp-size") == "1"
    check_sglang_args(args)  # the early check agrees


def test_not_installed_error_names_backend_and_package(tiny_model_dir, data_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang...` raises ImportError
    with pytest.raises(SlimeConfigError, match=r"--rollout-backend sglang .*pip install sglang"):
        _args(tiny_model_dir, data_file)  # at parse time, before Ray or any engine starts


_FAKE_LAUNCH_SERVER = """
# Test double for `python -m sglang.launch_server`: checks the line with the captured parser,
# records it, then serves the same port with slime's native engine.
import argparse, json, os, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
ns = p.parse_args(sys.argv[1:])
open(os.environ["FAKE_SGLANG_ARGV"], "w").write(json.dumps(sys.argv[1:]))
os.execv(sys.executable, [sys.executable, "-m", "slime.engines.native", "--model-path", ns.model_path,
         "--host", ns.host, "--port", str(ns.port), "--random-seed", str(ns.random_seed), "--num-threads", "1",
         "--max-running-requests", str(ns.max_running_requests), "--api-key", ns.api_key])
"""


def test_engine_server_launches_the_sglang_command(tiny_model_dir, data_file, tmp_path, monkeypatch):
    """EngineServer with --rollout-backend sglang: the command is built, started, waited for and
    stopped (a stand-in `sglang` package on PYTHONPATH serves it with the native engine)."""
    from slime.engines.launcher import EngineServer

    pkg = tmp_path / "pkgs" / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "server_args.py").write_text(
        "import argparse\n" + "".join(__import__("inspect").getsourcelines(_captured_add_cli_args)[0])
        + "\nclass ServerArgs:\n    add_cli_args = staticmethod(_captured_add_cli_args)\n")
    (pkg / "launch_server.py").write_text(_FAKE_LAUNCH_SERVER)
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "pkgs"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_SGLANG_ARGV", str(tmp_path / "argv.json"))
    args = _args(tiny_model_dir, data_file, "--output-dir", str(tmp_path / "out"), "--engine-startup-timeout", "120",
                 "--sglang-max-running-requests", "16")
    server = EngineServer(args, 0)
    url = server.start()
    try:
        info = EngineControl(url).server_info()
        assert (info["random_seed"], info["max_running_requests"]) == (7, 16)
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert argv[argv.index("--port") + 1] == url.rsplit(":", 1)[1]
        assert argv[-4:-2] == ["--max-running-requests", "16"] and argv[argv.index("--tp-size") + 1] == "1"
        assert argv[-2:] == ["--api-key", args.engine_api_key]  # SGLang's own flag carries the run's key
        proc = server.process
    finally:
        server.shutdown()
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]  # the stand-in package must not outlive this test
    assert proc.poll() is not None and (tmp_path / "out" / "logs" / "engine_0.log").is_file()


def test_engines_serve_the_dtype_asked_for(tiny_model_dir, data_file, fake_sglang):
    """--bf16 makes every kind serve bf16 unless its own --*-dtype says otherwise; without it the
    native engine serves the trainer's float32, vLLM the checkpoint's dtype, SGLang its own choice;
    weights are pushed in that dtype (TrainActor._engine_weights)."""
    from slime.engines.kinds import KINDS
    from slime.engines.native.cli import native_command

    def dtypes(*flags):
        args = _args(tiny_model_dir, data_file, *flags)
        return {name: kind.serve_dtype(args) for name, kind in KINDS.items()}, args

    plain, args = dtypes()
    assert plain == {"native": "float32", "sglang": None, "vllm": "float32"}  # the tiny checkpoint is float32
    assert "--dtype" not in sglang_command(args, 0, "127.0.0.1", 30000)
    bf16, args = dtypes("--bf16")
    assert bf16 == {"native": "bfloat16", "sglang": "bfloat16", "vllm": "bfloat16"}
    cmd = native_command(args, 0, "127.0.0.1", 30000, bf16["native"])
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    cmd = sglang_command(args, 0, "127.0.0.1", 30000, dtype="bfloat16")
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    asked, args = dtypes("--bf16", "--sglang-dtype", "float16", "--vllm-dtype", "float32")
    assert asked == {"native": "float16", "sglang": "float16", "vllm": "float32"}
    assert dtypes("--sglang-dtype", "auto")[0]["sglang"] is None
