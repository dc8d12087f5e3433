"""The SGLang backend without SGLang: command lines checked against a parser captured from
SGLang 0.5.23's ServerArgs, and every control call of `SGLangControl` made against the native
engine (which speaks SGLang's protocol), with bodies checked against SGLang's request structs."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import types

import pytest
import torch

from slime.arguments import parse_args
from slime.engines.client import EngineClient, EngineError, get_json, wait_until_healthy
from slime.engines.sglang import (
    SGLangControl,
    base_gpu_id,
    broadcast_layout,
    check_sglang_args,
    sglang_command,
    sglang_parser,
)
from slime.utils.errors import SlimeConfigError
from tests._native_server import native_server

# ----------------------------------------------------------------- captured from SGLang 0.5.23
# Field names of the request structs in sglang/srt/managers/io_struct.py (BaseReq adds rid and
# http_worker_ipc to each). A body slime sends must use only these names.
_BASE = {"rid", "http_worker_ipc"}
SGLANG_REQUEST_FIELDS = {
    "/abort_request": _BASE | {"abort_all", "finished_reason", "abort_message", "weight_versions"},
    "/pause_generation": _BASE | {"mode"},
    "/continue_generation": _BASE | {"torch_empty_cache"},
    "/release_memory_occupation": _BASE | {"tags"},
    "/resume_memory_occupation": _BASE | {"tags"},
    "/update_weights_from_disk": _BASE | {
        "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
        "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest"},
    "/init_weights_update_group": _BASE | {
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"},
    "/update_weights_from_distributed": _BASE | {
        "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
        "load_format", "selector", "torch_empty_cache"},
    "/update_weights_from_tensor": _BASE | {
        "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
        "selector", "torch_empty_cache"},
    "/destroy_weights_update_group": _BASE | {"group_name"},
    "/begin_weight_update": _BASE | {"selector"},
    "/end_weight_update": _BASE,
    "/flush_cache": set(),  # takes a `timeout` query parameter, no body fields
}
REQUIRED_FIELDS = {
    "/update_weights_from_disk": {"model_path"},
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes"},
    "/update_weights_from_tensor": {"serialized_named_tensors"},
}


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
    return parse_args(["--hf-checkpoint", tiny_model_dir, "--prompt-data", data_file, "--rollout-batch-size", "1",
                       "--num-rollout", "1", "--seed", "7", "--output-dir", "/tmp/unused",
                       "--rollout-backend", "sglang", *extra])


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
         "--max-running-requests", str(ns.max_running_requests)])
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
        info = get_json(url, "/get_server_info")
        assert (info["random_seed"], info["max_running_requests"]) == (7, 16)
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert argv[argv.index("--port") + 1] == url.rsplit(":", 1)[1]
        assert argv[-2:] == ["--max-running-requests", "16"] and argv[argv.index("--tp-size") + 1] == "1"
        proc = server.process
    finally:
        server.shutdown()
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]  # the stand-in package must not outlive this test
    assert proc.poll() is not None and (tmp_path / "out" / "logs" / "engine_0.log").is_file()


def test_broadcast_layout():
    # 3 engines of TP 2: trainer rank 0, engine i's TP ranks at 1 + 2i and 2 + 2i
    assert broadcast_layout(3, 2) == (7, [1, 3, 5])
    assert broadcast_layout(1, 1) == (2, [1])
    with pytest.raises(ValueError):
        broadcast_layout(0, 1)


_ENGINE_END = """
import datetime, json, sys, torch
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous
t = datetime.timedelta(seconds=60)
store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{sys.argv[1]}", 1, 2, timeout=t))
store.set_timeout(t)
pg, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), PrefixStore("wug", store), group_name="wug", timeout=t)
bufs = [torch.empty(3), torch.empty(2, 2, dtype=torch.bfloat16)]
for w in [pg.broadcast(b, 0) for b in bufs]:
    w.wait()
print(json.dumps([b.float().tolist() for b in bufs]))
"""


def test_trainer_group_meets_an_sglang_style_engine_end():
    """The trainer's group end (`new_group` rank 0, as `init_broadcast_group` makes it) and an
    engine process joined the way SGLang's
    init_custom_process_group joins (tcp:// rendezvous, PrefixStore(group), torch's
    _new_process_group_helper) exchange broadcasts, in order, over gloo."""
    import subprocess

    from slime.engines.launcher import free_port
    from slime.engines.native.weight_group import new_group

    port = free_port()
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE_END, str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        pg, _store = new_group("127.0.0.1", port, 0, 2, "wug", backend="gloo", timeout_s=60)
        sent = [torch.tensor([1.0, -2.0, 3.5]), torch.tensor([[0.5, 1.5], [2.5, -4.0]], dtype=torch.bfloat16)]
        for t in sent:
            pg.broadcast(t, 0).wait()
        out, err = engine.communicate(timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert engine.returncode == 0, err[-2000:]
    assert json.loads(out) == [t.float().tolist() for t in sent]


# ----------------------------------------------------------------- protocol calls


class _Recorder(EngineClient):
    """An EngineClient that records (method, path, body) and forwards to the server (or, with
    url None, answers {"success": true, "weight_version": "w"} itself)."""

    def __init__(self, url):
        super().__init__(url or "http://127.0.0.1:9", timeout=120)
        self.offline = url is None
        self.calls: list[tuple[str, str, dict | None]] = []

    async def _request(self, method, path, json=None, data=None, params=None, headers=None):
        self.calls.append((method, path, json))
        if self.offline:
            return {"success": True, "weight_version": "w"}
        return await super()._request(method, path, json=json, data=data, params=params, headers=headers)


def _check_schema(calls):
    for method, path, body in calls:
        if method != "POST" or path not in SGLANG_REQUEST_FIELDS:
            continue
        extra = set(body) - SGLANG_REQUEST_FIELDS[path]
        assert not extra, f"{path}: fields SGLang does not know: {extra}"
        missing = REQUIRED_FIELDS.get(path, set()) - set(body)
        assert not missing, f"{path}: missing required {missing}"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("sgl") / "log.txt") as (url, proc):
        yield url, proc


def _run(coro):
    return asyncio.run(coro)


def test_health_wait_rides_out_sglang_starting_503():
    """SGLang answers GET /health with an empty 503 while it starts; the wait keeps polling."""
    import http.server

    hits = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(503 if len(hits) <= 3 else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        wait_until_healthy(f"http://127.0.0.1:{srv.server_port}", timeout=10, poll_interval=0.05)
        assert hits == ["/health"] * 4 and time.monotonic() - t0 < 5
    finally:
        srv.shutdown()
        srv.server_close()


async def _running(client: EngineClient, timeout: float = 60.0) -> None:
    """Wait until the engine has a request running (not just queued)."""
    deadline = time.monotonic() + timeout
    while (await client.get("/get_server_info"))["num_running_requests"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        await asyncio.sleep(0.05)


def test_generation_controls_against_native(server):
    url, proc = server

    async def go():
        rec = _Recorder(url)
        ctl = SGLangControl(rec)
        try:
            # a long request, then pause / abort everything: it comes back as aborted
            payload = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True,
                                                                     "temperature": 0.0}, "rid": "long-1"}
            task = asyncio.create_task(rec.generate(payload))
            await _running(rec)
            await ctl.pause("retract")
            await ctl.continue_generation()
            await ctl.abort("long-1")
            out = await asyncio.wait_for(task, 60)
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert out["meta_info"]["completion_tokens"] < 400
            task = asyncio.create_task(rec.generate(dict(payload, rid="long-2")))
            await _running(rec)
            await ctl.abort()  # abort_all
            out = await asyncio.wait_for(task, 60)
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            await ctl.flush_cache()
            short = await rec.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3,
                                        "temperature": 0.0, "ignore_eos": True}})
            assert short["meta_info"]["completion_tokens"] == 3
            with pytest.raises(ValueError, match="pause mode"):
                await ctl.pause("sleep")
        finally:
            await rec.close()
        return rec.calls

    calls = _run(go())
    assert [(m, p) for m, p, _ in calls if p not in ("/generate", "/get_server_info")] == [
        ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/abort_request"),
        ("POST", "/abort_request"), ("POST", "/flush_cache")]
    bodies = {p: b for _, p, b in calls if p != "/abort_request"}
    assert bodies["/pause_generation"] == {"mode": "retract"}
    assert [b for _, p, b in calls if p == "/abort_request"] == [{"rid": "long-1"}, {"abort_all": True}]
    _check_schema(calls)
    assert proc.poll() is None


def test_disk_update_memory_and_weight_version_against_native(server, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from slime.utils.weights import tensor_digest

    url, proc = server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    model.save_pretrained(tmp_path / "v2")

    async def go():
        rec = _Recorder(url)
        ctl = SGLangControl(rec)
        try:
            before = await ctl.weight_version()
            assert await ctl.begin_weight_update() is False  # native: no session needed (404)
            await ctl.release_memory()
            await ctl.resume_memory()
            await ctl.release_memory(["kv_cache"])
            await ctl.resume_memory(["kv_cache"])
            resp = await ctl.update_weights_from_disk(str(tmp_path / "v2"), weight_version="v2")
            assert resp["success"] is True
            assert await ctl.end_weight_update() is False
            after = await ctl.weight_version()
            out = await rec.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2,
                                      "temperature": 0.0}})
            with pytest.raises(EngineError) as ei:
                await ctl.update_weights_from_disk(str(tmp_path / "missing"), weight_version="v3")
            return before, after, out, ei.value
        finally:
            await rec.close()
        return None

    before, after, out, err = _run(go())
    assert before != "v2" and after == "v2" and out["meta_info"]["weight_version"] == "v2"
    assert err.status == 400 and "missing" in str(err)
    assert get_json(url, "/weights_checksum")["checksums"]["model.norm.weight"] == tensor_digest(
        model.model.norm.weight)
    assert proc.poll() is None


def test_distributed_update_with_sglang_bodies_against_native(server, tiny_model_dir):
    """init_weights_update_group + update_weights_from_distributed with SGLang's bodies; the
    trainer's end is rank 0 of the group the native engine joins (gloo on CPU)."""
    from transformers import AutoModelForCausalLM

    from slime.engines.native.weight_group import new_group
    from slime.engines.launcher import free_port
    from slime.utils.weights import tensor_digest

    url, proc = server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.add_(0.25)
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    sent = [("model.norm.weight", model.model.norm.weight.detach().clone()),
            ("model.layers.0.mlp.down_proj.weight", model.model.layers[0].mlp.down_proj.weight.detach().clone())]
    world, offsets = broadcast_layout(1, 1)
    port = free_port()

    async def go():
        rec = _Recorder(url)
        ctl = SGLangControl(rec)
        try:
            join = asyncio.create_task(ctl.init_weights_update_group("127.0.0.1", port, offsets[0], world,
                                                                     group_name="sgl", backend="gloo"))
            pg, store = await asyncio.to_thread(new_group, "127.0.0.1", port, 0, world, "sgl", "gloo", 60)
            assert (await join)["success"] is True
            upd = asyncio.create_task(ctl.update_weights_from_distributed(
                [n for n, _ in sent], [t.dtype for _, t in sent], [list(t.shape) for _, t in sent],
                group_name="sgl", weight_version="d1"))

            def bcast():
                for _, t in sent:
                    pg.broadcast(t, 0).wait()

            await asyncio.to_thread(bcast)
            resp = await upd
            version = await ctl.weight_version()
            await ctl.destroy_weights_update_group("sgl")
            return resp, version, store
        finally:
            await rec.close()

    resp, version, _store = _run(go())
    assert resp["success"] is True and version == "d1"
    sums = get_json(url, "/weights_checksum")["checksums"]
    assert [sums[n] for n, _ in sent] == [tensor_digest(t) for _, t in sent]
    assert "sgl" not in get_json(url, "/get_server_info")["weight_update_groups"]
    assert proc.poll() is None


def test_request_bodies_match_sglang_structs():
    """Every body SGLangControl builds (tensor update included, which the native engine takes
    only in binary form) uses only SGLang's field names and carries the required ones."""

    async def go():
        c = _Recorder(None)
        ctl = SGLangControl(c)
        await ctl.abort("r")
        await ctl.abort()
        await ctl.pause("abort")
        await ctl.continue_generation()
        await ctl.flush_cache()
        await ctl.release_memory(["weights"])
        await ctl.resume_memory()
        await ctl.begin_weight_update()
        await ctl.update_weights_from_disk("/m", weight_version=3, flush_cache=False)
        await ctl.init_weights_update_group("10.0.0.1", 29500, 3, 7, group_name="g")
        await ctl.update_weights_from_distributed(["a"], [torch.bfloat16], [[2, 3]], group_name="g",
                                                  weight_version="4")
        await ctl.update_weights_from_tensor(["QUJD", "REVG"], weight_version="5")
        await ctl.end_weight_update()
        await ctl.destroy_weights_update_group("g")
        assert await ctl.weight_version() == "w"
        with pytest.raises(ValueError, match="one per TP rank"):
            await ctl.update_weights_from_tensor([])
        return c.calls

    calls = _run(go())
    _check_schema(calls)
    by_path = {p: b for _, p, b in calls}
    assert by_path["/update_weights_from_distributed"] == {
        "names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "group_name": "g", "flush_cache": True,
        "weight_version": "4"}
    assert by_path["/update_weights_from_tensor"] == {"serialized_named_tensors": ["QUJD", "REVG"],
                                                     "flush_cache": True, "weight_version": "5"}
    assert by_path["/update_weights_from_disk"] == {"model_path": "/m", "flush_cache": False,
                                                   "abort_all_requests": False, "weight_version": "3"}
    assert by_path["/init_weights_update_group"] == {"master_address": "10.0.0.1", "master_port": 29500,
                                                    "rank_offset": 3, "world_size": 7, "group_name": "g",
                                                    "backend": "nccl"}
    assert by_path["/release_memory_occupation"] == {"tags": ["weights"]}
    assert by_path["/resume_memory_occupation"] == {}
    assert ("GET", "/model_info", None) in calls


def test_success_false_is_an_error():
    """SGLang can answer {"success": false} with HTTP 200 too: that is an EngineError with its message."""
    from aiohttp import web

    async def disk(request):
        return web.json_response({"success": False, "message": "no such dir"})

    async def go():
        app = web.Application()
        app.router.add_post("/update_weights_from_disk", disk)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ctl = SGLangControl(EngineClient(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"))
        try:
            with pytest.raises(EngineError, match="did not succeed: 'no such dir'"):
                await ctl.update_weights_from_disk("/x")
        finally:
            await ctl.client.close()
            await runner.cleanup()

    _run(go())
