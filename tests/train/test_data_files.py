"""Reading data files (JSONL, JSON arrays, Parquet, text; a directory of them) and bad input:
an error naming the file and line, or with ``data_skip_bad`` a counted, reported skip; never a
silent drop."""

from __future__ import annotations

import json
import re

import pytest

from layerwise.train.data import DataSpec, prepare_data
from layerwise.train.data_files import data_files, read_records
from layerwise.train.tokenizer import ByteTokenizer, load_tokenizer

from .tiny_hf import make_model_dir

GOOD_PC = json.dumps({"prompt": "q ", "completion": "a"})
GOOD_CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "hello"}]})

# (name, lines, the error's place and reason, the ledger kind)
BAD_CASES = [
    ("malformed JSON", [GOOD_PC, '{"prompt": "q", "completion": "a"', GOOD_PC],
     r"d\.jsonl:2: malformed JSON", "malformed"),
    ("not an object", [GOOD_PC, "[1, 2]", GOOD_PC], r"d\.jsonl:2: expected a JSON object", "malformed"),
    ("missing field", [GOOD_PC, GOOD_PC, '{"prompt": "q"}', GOOD_PC],
     r"d\.jsonl:3: missing field 'completion' for data.format=prompt_completion", "missing field"),
    ("wrong type", [GOOD_PC, '{"prompt": "q", "completion": 3}'],
     r"d\.jsonl:2: field 'completion' must be a string", "missing field"),
    ("empty text", ['{"text": "abc"}', '{"text": "  "}', '{"text": "de"}'],
     r"d\.jsonl:2: empty 'text'", "no trainable tokens"),
    ("no assistant turn", [GOOD_CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                           GOOD_CHAT], r"d\.jsonl:2: no assistant turn", "no trainable tokens"),
    ("bad message", [GOOD_CHAT, json.dumps({"messages": [{"content": "hi"}]}), GOOD_CHAT],
     r"d\.jsonl:2: messages\[0\] must be an object with a string 'role'", "missing field"),
]


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return load_tokenizer("auto", str(make_model_dir(tmp_path_factory.mktemp("m"))))[0]


def _spec(path, **kw):
    return DataSpec(data=str(path), eval_data=str(path), seq_len=64, cache=False, **kw)


@pytest.mark.parametrize("name,lines,error,kind", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_is_an_error_naming_file_and_line_or_a_counted_skip(tmp_path, chat_tok, name,
                                                                      lines, error, kind):
    """Mutations this fails on: the ledger not raising without ``skip`` (``if False:`` in
    ``BadInputLedger.add``: a silent drop); a skip not counted (no ``counts[kind] += 1``)."""
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tok = chat_tok if "messages" in lines[0] else ByteTokenizer()
    with pytest.raises(ValueError, match=error + r".*data.skip_bad=true"):
        prepare_data(_spec(path), tok, tmp_path)
    data = prepare_data(_spec(path, skip_bad=True), tok, tmp_path)
    assert data.report["bad"]["counts"] == {kind: 2}  # the bad line, read as train and as eval
    assert data.report["train_examples"] == len(lines) - 1
    summary = "\n".join(data.summary())
    assert f"skipped 2 bad example(s) (data.skip_bad=true): {kind} 2" in summary
    assert re.search(error.split(": ")[0], summary)  # names the first skipped one


def test_empty_and_all_bad_datasets_are_errors_even_when_skipping(tmp_path):
    path = tmp_path / "d.jsonl"
    for skip in (False, True):
        path.write_text("\n\n")
        with pytest.raises(ValueError, match=r"no readable record in .*d\.jsonl"):
            prepare_data(_spec(path, skip_bad=skip), ByteTokenizer(), tmp_path)
        with pytest.raises(ValueError, match=r"no usable examples in .*d\.jsonl"):
            prepare_data(_spec(path, skip_bad=skip, data_format="text"), ByteTokenizer(), tmp_path)
    path.write_text('{"prompt": "q"}\n{"prompt": "q"}\n')
    with pytest.raises(ValueError, match=r"no usable examples .*2 skipped as bad"):
        prepare_data(DataSpec(data=str(path), data_format="prompt_completion", seq_len=64,
                              eval_fraction=0.5, skip_bad=True, cache=False),
                     ByteTokenizer(), tmp_path)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="no data files"):
        prepare_data(_spec(empty_dir), ByteTokenizer(), tmp_path)


def test_unknown_fields_and_too_small_datasets_are_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:1: data.format=auto found none of the known"):
        prepare_data(_spec(path), ByteTokenizer(), tmp_path)
    path.write_text('{"text": "one example"}\n')
    with pytest.raises(ValueError, match="too few to hold out data.eval_fraction"):
        prepare_data(DataSpec(data=str(path), cache=False), ByteTokenizer(), tmp_path)
    with pytest.raises(ValueError, match="data_format 'alpaca'"):
        prepare_data(_spec(path, data_format="alpaca"), ByteTokenizer(), tmp_path)


def test_reads_jsonl_json_parquet_and_text_files_of_a_directory(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text('{"text": "a1"}\n\n{"text": "a2"}\n')
    (d / "b.json").write_text('[\n  {"text": "b1"},\n  {"text": "b2"}\n]\n')
    (d / "c.json").write_text('{"text": "c1"}\n{"text": "c2"}\n')  # JSON Lines named .json
    pq.write_table(pa.table({"text": ["d1", "d2"]}), d / "d.parquet")
    (d / "sub" / "e.md").write_text("# e\n")
    (d / ".hidden.txt").write_text("no")
    (d / "notes.csv").write_text("no")
    recs = [(r.where.replace(str(d) + "/", ""), r.value) for r in read_records(data_files(d))]
    assert recs == [("a.jsonl:1", {"text": "a1"}), ("a.jsonl:3", {"text": "a2"}),
                    ("b.json:2", {"text": "b1"}), ("b.json:3", {"text": "b2"}),
                    ("c.json:1", {"text": "c1"}), ("c.json:2", {"text": "c2"}),
                    ("d.parquet row 1", {"text": "d1"}), ("d.parquet row 2", {"text": "d2"}),
                    ("sub/e.md:1", {"text": "# e\n"})]
    with pytest.raises(ValueError, match="unsupported type '.csv'"):
        data_files(d / "notes.csv")
    (d / "b.json").write_text('[\n  {"text": "b1"},\n  {"text": "b2"\n]\n')
    with pytest.raises(ValueError, match=r"b\.json:4: malformed JSON .*cannot be skipped in part"):
        list(read_records(data_files(d / "b.json")))
