"""Packing keeps examples apart, text is split without loss, truncation is counted, and the
batch order is deterministic and resumes at exactly the next example."""

from __future__ import annotations

import json
import random

import pytest
import torch

from layerwise.engine.batch import IGNORE_INDEX
from layerwise.train.data import DataSpec, prepare_data
from layerwise.train.packing import pack_examples, row_batches, shift
from layerwise.train.tokenizer import ByteTokenizer


def _examples(seed: int = 0, n: int = 40, seq_len: int = 32):
    """Supervised examples with disjoint token ranges (example k uses ids 1000*k + …), random
    lengths up to ``seq_len + 1`` tokens and a random prompt/answer split."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        length = rng.randint(2, seq_len + 1)
        ids = [1000 * (k + 1) + i for i in range(length)]
        prompt = rng.randint(1, length - 1)
        out.append(shift(ids, [False] * prompt + [True] * (length - prompt), seq_len, False)[0])
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_packing_keeps_examples_separate(pack):
    """Every supervised example sits whole in one row, contiguous, with its own targets and
    none of another's: a label at a position is always a later token of the same example.

    Mutation this fails on: a supervised example allowed to run over the row's end
    (``if not pack or …`` reduced to ``if not pack:`` in ``pack_examples``)."""
    seq_len = 32
    examples = _examples(seq_len=seq_len)
    rows, stats = pack_examples(examples, seq_len, pad_id=0, pack=pack)
    ids, labels, segs = rows.input_ids, rows.labels, rows.segment_ids
    assert ids.shape == labels.shape == segs.shape and ids.shape[1] == seq_len
    assert stats.positions == sum(len(e.inputs) for e in examples)
    seen = set()
    for r in range(len(rows)):
        row_segs = segs[r].tolist()
        for k in set(row_segs) - {-1}:
            where = [i for i, s in enumerate(row_segs) if s == k]
            assert where == list(range(where[0], where[0] + len(where)))  # contiguous
            assert ids[r, where].tolist() == examples[k].inputs  # whole, in one row
            assert labels[r, where].tolist() == examples[k].targets
            assert k not in seen
            seen.add(k)
        for i, t in enumerate(labels[r].tolist()):
            if t != IGNORE_INDEX:  # the target is the same example's next token
                assert t // 1000 == int(ids[r, i]) // 1000 and t == int(ids[r, i]) + 1
        pad = [i for i, s in enumerate(row_segs) if s == -1]
        assert all(labels[r, i] == IGNORE_INDEX for i in pad)
        if not pack:
            assert len(set(row_segs) - {-1}) == 1
    assert seen == set(range(len(examples)))
    if pack:
        assert len(rows) < len(examples)  # packing did pack


def test_long_text_is_split_across_rows_every_target_once(tmp_path):
    """A text example longer than a row continues in the next one: concatenated, the rows'
    labels are the text's tokens after the first, each exactly once, and the rest is padding.
    Mutation this fails on: text treated like supervised data (``splittable=False`` for
    ``text`` in ``encode_example``: truncated to one row)."""
    tok = ByteTokenizer()
    text = "def add(a, b):\n    return a + b\n" * 5
    (tmp_path / "long.py").write_text(text)
    (tmp_path / "eval.txt").write_text("x = 1\n")
    data = prepare_data(DataSpec(data=str(tmp_path / "long.py"), eval_data=str(tmp_path / "eval.txt"),
                                 seq_len=16, cache=False), tok, tmp_path)
    ids = tok.encode(text)
    segs = data.train.segment_ids.flatten()
    assert data.train.labels.flatten()[segs == 0].tolist() == ids[1:]
    assert data.train.input_ids.flatten()[segs == 0].tolist() == ids[:-1]
    assert (data.train.labels.flatten()[segs == -1] == IGNORE_INDEX).all()
    assert data.report["train_pack"]["split_examples"] == 1 and data.report["truncated"] == 0


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_truncation_is_counted_and_a_prompt_past_seq_len_refused(tmp_path):
    """A supervised example longer than seq_len is cut at the end and counted; one whose
    answer starts past seq_len has no trainable tokens: an error naming the line."""
    path = _write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "q", "completion": "a" * 10},
        {"prompt": "q", "completion": "a" * 100},  # 103 tokens with BOS/EOS: 102 positions
        {"prompt": "q" * 40, "completion": "b"},
    ])
    spec = DataSpec(data=str(path), eval_data=str(path), seq_len=32, cache=False)
    with pytest.raises(ValueError, match=rf"pc.jsonl:3: no trainable tokens within seq_len=32"):
        prepare_data(spec, ByteTokenizer(), tmp_path)
    _write_jsonl(path, [{"prompt": "q", "completion": "a" * 10},
                        {"prompt": "q", "completion": "a" * 100}])
    data = prepare_data(spec, ByteTokenizer(), tmp_path)
    assert data.report["truncated"] == 2  # one train, one eval (the same file)
    assert data.report["truncated_positions"] == 2 * (102 - 32)
    assert "truncated 2 example(s) (140 positions cut)" in "\n".join(data.summary())


def _chat_like_file(tmp_path, n=50):
    return _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{k} ", "completion": f"answer {k}"}
                                               for k in range(n)])


def test_resume_mid_epoch_continues_with_the_exact_next_example(tmp_path):
    """The stream from micro-batch ``k`` (what a checkpoint's ``data_position`` holds) is the
    uninterrupted stream's tail, at every k, mid-epoch and across epochs, also with the data
    loaded from the tokenization cache (a resumed run does not tokenize again).

    Mutations this fails on: the permutation seeded without the epoch (``manual_seed(seed)``:
    later epochs repeat the first); ``start`` ignored (``index = 0``)."""
    spec = DataSpec(data=str(_chat_like_file(tmp_path)), seq_len=24, seed=3)
    data = prepare_data(spec, ByteTokenizer(), tmp_path)
    assert data.report["cache"].startswith("cached in")
    again = prepare_data(spec, ByteTokenizer(), tmp_path)
    assert again.report["cache"].startswith("loaded from")
    assert torch.equal(again.train.input_ids, data.train.input_ids)
    assert torch.equal(again.train.labels, data.train.labels)
    rows = len(data.train)
    per_epoch = rows // 4
    stream = data.batches(4, seed=7)
    straight = [next(stream) for _ in range(3 * per_epoch + 2)]
    epochs = [torch.cat([b.input_ids for b in straight[e * per_epoch:(e + 1) * per_epoch]])
              for e in range(3)]
    assert not torch.equal(epochs[0], epochs[1])  # each epoch has its own order
    for k in (1, per_epoch - 1, per_epoch, per_epoch + 1, 3 * per_epoch):
        resumed = again.batches(4, seed=7, start=k)
        for want in straight[k:k + 2]:
            got = next(resumed)
            assert torch.equal(got.input_ids, want.input_ids)
            assert torch.equal(got.labels, want.labels)


def test_the_cache_key_follows_files_tokenizer_and_settings(tmp_path):
    path = _chat_like_file(tmp_path)
    spec = DataSpec(data=str(path), seq_len=24)
    key = prepare_data(spec, ByteTokenizer(), tmp_path).key
    assert prepare_data(DataSpec(data=str(path), seq_len=32), ByteTokenizer(), tmp_path).key != key
    assert prepare_data(DataSpec(data=str(path), seq_len=24, pack=False), ByteTokenizer(),
                        tmp_path).key != key
    _chat_like_file(tmp_path, n=51)
    data = prepare_data(spec, ByteTokenizer(), tmp_path)
    assert data.key != key and data.report["cache"].startswith("cached in")


def test_row_batches_refuses_fewer_rows_than_a_batch():
    x = torch.zeros(3, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="fewer than the micro-batch size 4"):
        next(row_batches(x, x, 4))
