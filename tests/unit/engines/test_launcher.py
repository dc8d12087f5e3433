
from slime.engines.native.cli import native_command
from slime.engines.passthrough import PassThrough
from tests.helpers.args import make_args


def test_sglang_flags_forwarded_to_native_engine(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, "--seed", 5, "--sglang-max-running-requests", 16,
                     "--sglang-mem-fraction-static", 0.8, "--sglang-port", 1, "--sglang-random-seed", 9)
    cmd = native_command(args, rank=1, host="127.0.0.1", port=4321)
    assert cmd[1:3] == ["-m", "slime.engines.native"]
    assert cmd[cmd.index("--port") + 1] == "4321"  # managed by slime, --sglang-port ignored
    assert cmd.count("--port") == 1
    assert cmd[cmd.index("--max-running-requests") + 1] == "16"
    assert "--mem-fraction-static" not in cmd  # no such native flag
    # a forwarded flag comes after slime's default, so argparse keeps the user's value
    seeds = [cmd[i + 1] for i, t in enumerate(cmd) if t == "--random-seed"]
    assert seeds == ["6", "9"]


def test_forwarded_flags_bare_and_valued():
    import argparse

    from slime.engines.passthrough import option_table

    parser = argparse.ArgumentParser()
    parser.add_argument("--a-b", action="store_true")
    parser.add_argument("--c")
    lenient = PassThrough("--sglang-", "the native engine", options=option_table(parser), strict=False)
    flags, dests = lenient.forward({"a_b": True, "c": "1", "zz": "2"})
    assert flags == ["--a-b", "--c", "1"] and dests == {"a_b", "c"}  # zz: not the server's, skipped


def test_engine_threads_follow_the_cpu_split(tiny_model_dir, tmp_path, monkeypatch):
    """train.py gives an engine every core; train_async.py, which trains while it generates,
    gives engines and train ranks their shares (16 cores, 1 rank, 3 engines: 12 for the engines)."""
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    flags = ["--rollout-num-gpus", 3]

    def threads(args):
        cmd = native_command(args, rank=0, host="127.0.0.1", port=1)
        return cmd[cmd.index("--num-threads") + 1]

    assert threads(make_args(tiny_model_dir, tmp_path, *flags)) == "5"  # 16 // 3
    assert threads(make_args(tiny_model_dir, tmp_path, *flags, overlap_training=True)) == "4"  # 16 * 3/4 // 3


def test_an_engine_whose_port_was_taken_before_it_bound_is_launched_on_another(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """free_port's port can be taken by another process before the engine binds it (CI saw a train
    rank's process group take one): the engine exits unable to bind, and the launcher starts it again
    on another port instead of failing the run."""
    import socket

    from slime.engines import launcher
    from slime.utils.net import free_port

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    second = free_port("127.0.0.1")
    ports = [taken.getsockname()[1], second]
    monkeypatch.setattr(launcher, "free_port", lambda host: ports.pop(0))
    server = launcher.EngineServer(make_args(tiny_model_dir, tmp_path), rank=0)
    try:
        assert server.start() == f"http://127.0.0.1:{second}"
        assert not ports and server.is_alive()
    finally:
        server.shutdown()
        taken.close()
