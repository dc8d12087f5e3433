import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from slime.data.dataset import load_prompts
from slime.data.source import PromptOrder
from slime.types import RolloutBatch
from slime.utils.errors import DataError


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_string_and_chat_prompts(tok, tmp_path):
    rows = [
        {"q": "parity of 7", "a": "1", "metadata": {"k": 1}},
        {"q": [{"role": "system", "content": "say yes"}, {"role": "user", "content": "hello"}], "a": "0"},
    ]
    prompts = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), tok, "q", "a", apply_chat_template=True)
    assert [p.label for p in prompts] == ["1", "0"]
    assert prompts[0].metadata == {"k": 1} and prompts[1].metadata == {}
    expected = tok.apply_chat_template([{"role": "user", "content": "parity of 7"}], tokenize=False,
                                       add_generation_prompt=True)
    assert prompts[0].input_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.decode(prompts[1].input_ids).endswith("<|im_start|> assistant")


def test_raw_string_without_template(tok, tmp_path):
    prompts = load_prompts(write_jsonl(tmp_path / "d.jsonl", [{"q": "1 + 2 ="}]), tok, "q")
    assert tok.decode(prompts[0].input_ids) == "1 + 2 ="
    assert prompts[0].label is None


def test_parquet(tok, tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["parity of 3", "parity of 4"], "a": ["1", "0"]}), path)
    prompts = load_prompts(path, tok, "q", "a", apply_chat_template=True)
    assert [p.label for p in prompts] == ["1", "0"]
    assert prompts[0].where.endswith("row 0")


def test_malformed_line_names_file_and_line(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"q": "a", "a": "1"}\n{"q": "b", "a": \n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON"):
        load_prompts(path, tok, "q", "a")


def test_missing_label_names_field_and_line(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "a", "a": "1"}, {"q": "b"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing field 'a' \(--label-key\)"):
        load_prompts(path, tok, "q", "a")


def test_chat_prompt_needs_template(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": [{"role": "user", "content": "x"}]}])
    with pytest.raises(DataError, match="pass --apply-chat-template"):
        load_prompts(path, tok, "q")


def test_long_prompts_dropped(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1 2 3 4 5 6"}, {"q": "1"}])
    prompts = load_prompts(path, tok, "q", max_prompt_len=3)
    assert len(prompts) == 1 and tok.decode(prompts[0].input_ids) == "1"


def _ids(prompts):
    return [p.label for p in prompts]


def test_data_source_epochs_shuffle_and_state(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "x", "a": str(i)} for i in range(5)])
    prompts = load_prompts(path, tok, "q", "a")
    plain = PromptOrder(prompts, shuffle=False)
    assert _ids(plain.take(3)) == ["0", "1", "2"]
    assert _ids(plain.take(4)) == ["3", "4", "0", "1"]  # crosses into epoch 1
    assert plain.epoch == 1

    src = PromptOrder(prompts, shuffle=True, seed=7)
    first_epoch = _ids(src.take(5))
    assert sorted(first_epoch) == ["0", "1", "2", "3", "4"] and first_epoch != ["0", "1", "2", "3", "4"]
    src.take(2)
    state = src.state_dict()
    expected = _ids(src.take(6))
    resumed = PromptOrder(prompts, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    assert _ids(resumed.take(6)) == expected


def test_resume_refuses_other_data_or_order_naming_what_changed(tok, tmp_path):
    rows = [{"q": f"question {i}", "a": str(i)} for i in range(5)]
    prompts = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), tok, "q", "a")
    saved = PromptOrder(prompts, shuffle=True, seed=7)
    saved.take(3)
    state = saved.state_dict()
    assert len(state["fingerprint"]) == 16

    def refusal(items, **kw) -> str:
        with pytest.raises(DataError) as e:
            PromptOrder(items, **kw).load_state_dict(state)
        assert str(e.value).startswith("cannot resume the data where the checkpoint stopped: ")
        return str(e.value)

    # an edited file of the same size (one label changed)
    edited = load_prompts(write_jsonl(tmp_path / "e.jsonl", rows[:4] + [{"q": "question 4", "a": "44"}]), tok, "q", "a")
    assert "the prompt data's content changed" in refusal(edited, shuffle=True, seed=7)
    assert "the prompt data has 4 prompts, the checkpoint's had 5" in refusal(prompts[:4], shuffle=True, seed=7)
    assert "--rollout-seed was 7, now 8" in refusal(prompts, shuffle=True, seed=8)
    assert "--rollout-shuffle was on, now off" in refusal(prompts, shuffle=False, seed=7)
    both = refusal(edited, shuffle=True, seed=9)
    assert "content changed" in both and "--rollout-seed was 7, now 9" in both
    # the same data read again (another path, same rows) resumes; a seed change without shuffling is harmless
    again = PromptOrder(load_prompts(write_jsonl(tmp_path / "copy.jsonl", rows), tok, "q", "a"), shuffle=True, seed=7)
    again.load_state_dict(state)
    assert _ids(again.take(2)) == _ids(saved.take(2))
    plain = PromptOrder(prompts, shuffle=False, seed=1)
    plain.take(2)
    PromptOrder(prompts, shuffle=False, seed=2).load_state_dict(plain.state_dict())
    # a checkpoint written before the fingerprint existed still resumes
    PromptOrder(prompts, shuffle=True, seed=7).load_state_dict({k: v for k, v in state.items() if k != "fingerprint"})


def test_split_for_ranks_keeps_steps_aligned():
    n = 8
    batch = RolloutBatch(
        tokens=[[i] for i in range(n)], response_lengths=[1] * n, loss_masks=[[1]] * n,
        rewards=[float(i) for i in range(n)], raw_rewards=[0.0] * n, rollout_log_probs=[[0.0]] * n,
        group_indices=list(range(n)),
    )
    r0, r1 = batch.split_for_ranks(dp_size=2, global_batch_size=4)
    # step 0 = samples 0-3 (rank0: 0,1; rank1: 2,3); step 1 = samples 4-7
    assert r0.rewards == [0.0, 1.0, 4.0, 5.0]
    assert r1.rewards == [2.0, 3.0, 6.0, 7.0]
