"""Prepared data (`qeffect prepare-data`, `train --data DIR`): the folder format, memory-mapped reading equal
to the in-memory packing, data-parallel slices, exact resume, and bad input in one line before any model."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel

from qeffect.cli.app import main
from qeffect.config import load_config
from qeffect.data import DataStream, PackedDataset, PreparedFolder, load_datasets, load_tokenizer, plan_data
from qeffect.data import records as R
from qeffect.data.prepare import prepare_data
from qeffect.data.prepared import Permutation, dtype_for
from qeffect.data.tokenizer import bundled_asset, file_sha256, resolve_eot
from qeffect.errors import UserError

TEXTS = [f"document {i}: the quick brown fox jumps over the lazy dog. " * (1 + i % 4) for i in range(60)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _jsonl(path: Path, texts: list[str], field: str = "text", gz: bool = False) -> Path:
    payload = "".join(json.dumps({field: t, "url": "u"}) + "\n" for t in texts).encode()
    path.write_bytes(gzip.compress(payload) if gz else payload)
    return path


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ---- format ----


def test_prepare_jsonl_index_and_tokens_equal_packing(tmp_path, tok):
    src = _jsonl(tmp_path / "c.jsonl", TEXTS)
    index = prepare_data([src], tmp_path / "prep")
    folder = PreparedFolder(tmp_path / "prep")
    assert folder.index == index
    raw = json.loads((tmp_path / "prep" / "index.json").read_text())
    assert raw["format"] == "qeffect-prepared" and raw["version"] == 1 and raw["dtype"] == "uint16"
    assert sorted(p.name for p in (tmp_path / "prep").iterdir()) == ["documents.npy", "index.json", "tokens.bin"]
    assert index.tokenizer_sha256 == file_sha256(bundled_asset("tokenizer.json"))
    assert (index.eot, index.eot_id, index.vocab_size) == ("<|endoftext|>", 0, 32768)
    assert index.num_documents == 60 and index.sources[0].documents == 60
    assert index.sources[0].sha256 == hashlib.sha256(src.read_bytes()).hexdigest()
    assert index.sources[0].bytes == src.stat().st_size
    assert index.tokens_sha256 == hashlib.sha256((tmp_path / "prep" / "tokens.bin").read_bytes()).hexdigest()
    # the layout: every document's ids then the end-of-text id, in input order; offsets in documents.npy
    expect, starts = [], []
    for t in TEXTS:
        starts.append(len(expect))
        expect += tok.encode(t, add_special_tokens=False).ids + [0]
    assert folder.tokens.dtype == np.dtype("<u2") and folder.tokens.tolist() == expect
    assert folder.documents.tolist() == starts
    # the split: the last ceil(60 / 10) = 6 documents, the same tokens load_datasets holds out of the JSON lines
    s = index.split
    assert s.train_documents == (0, 54) and s.heldout_documents == (54, 60)
    assert s.train_tokens == (0, starts[54]) and s.heldout_tokens == (starts[54], len(expect))
    train, held = load_datasets(str(src), tok, 8)
    mtrain, mheld = load_datasets(str(tmp_path / "prep"), tok, 8)
    assert np.array_equal(mtrain.tokens, train.tokens.numpy()) and np.array_equal(mheld.tokens, held.tokens.numpy())
    assert len(mtrain) == len(train) and mtrain.num_documents == 54
    idx = [0, 5, len(train) - 1, 3]
    for a, b in zip(mtrain.sequences(idx), train.sequences(idx), strict=True):
        assert a.dtype == torch.int64 and torch.equal(a, b)
    for a, b in zip(mheld.batch(1, 2), held.batch(1, 2), strict=True):
        assert torch.equal(a, b)


def test_json_gz_text_field_and_plain_text(tmp_path, tok, monkeypatch):
    gz = _jsonl(tmp_path / "shard.json.gz", TEXTS[:5], field="body", gz=True)
    text = "First line of a plain file.\nSecond line,  with  spaces.\n\n  Indented third.\nlast\n" * 40
    (tmp_path / "notes.txt").write_text(text)
    monkeypatch.setattr(R, "TEXT_PIECE_CHARS", 100)  # several pieces, cut at newlines: the same ids as one piece
    index = prepare_data([gz, str(tmp_path / "*.txt")], tmp_path / "out", text_field="body", heldout_fraction=0)
    expect = []
    for t in [*TEXTS[:5], text]:
        expect += tok.encode(t, add_special_tokens=False).ids + [0]
    folder = PreparedFolder(tmp_path / "out")
    assert folder.tokens.tolist() == expect
    assert [(s.kind, s.documents) for s in index.sources] == [("jsonl", 5), ("text", 1)]
    assert index.num_documents == 6 and index.split.heldout_documents == (6, 6) and index.text_field == "body"


def test_parquet_input(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": list(range(20)), "text": TEXTS[:20]}), path, row_group_size=7)
    index = prepare_data([path], tmp_path / "out")
    expect = []
    for t in TEXTS[:20]:
        expect += tok.encode(t, add_special_tokens=False).ids + [0]
    assert PreparedFolder(tmp_path / "out").tokens.tolist() == expect
    assert index.sources[0].kind == "parquet" and index.split.heldout_documents == (18, 20)
    with pytest.raises(UserError, match=r'c\.parquet: no column "body" \(columns: id, text\)'):
        prepare_data([path], tmp_path / "o2", text_field="body")
    with pytest.raises(UserError, match=r'c\.parquet: column "id" is int64, not a string'):
        prepare_data([path], tmp_path / "o2", text_field="id")
    assert not (tmp_path / "o2").exists()


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import pyarrow.parquet` raises ImportError
    with pytest.raises(UserError, match=r"reading parquet needs pyarrow: pip install 'qeffect\[parquet\]'"):
        prepare_data([tmp_path / "c.parquet"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _wordlevel(path: Path, size: int, eos: str | None) -> Path:
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(size - 2)}}
    if eos is not None:
        vocab[eos] = size - 1
    t = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if eos is not None:
        t.add_special_tokens([eos])
        t.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, size - 1)])
    t.save(str(path))
    return path


def test_dtype_choice_and_eot_from_post_processor(tmp_path):
    assert (dtype_for(2), dtype_for(65536), dtype_for(65537)) == ("uint16", "uint16", "uint32")
    big = _wordlevel(tmp_path / "big.json", 70000, "</s>")
    assert resolve_eot(Tokenizer.from_file(str(big))) == ("</s>", 69999)
    src = _jsonl(tmp_path / "w.jsonl", ["w1 w69990 w5", "w7 w8", "w65536 w2"])
    index = prepare_data([src], tmp_path / "out", tokenizer=str(big), heldout_fraction=0.3)
    assert (index.dtype, index.eot, index.eot_id, index.tokenizer) == ("uint32", "</s>", 69999, str(big))
    tokens = PreparedFolder(tmp_path / "out").tokens
    assert tokens.dtype == np.dtype("<u4")
    assert tokens.tolist() == [2, 69991, 6, 69999, 8, 9, 69999, 65537, 3, 69999]
    assert index.split.train_tokens == (0, 7)


def test_eot_configured_or_one_line_error(tmp_path):
    none = _wordlevel(tmp_path / "none.json", 50, None)
    src = _jsonl(tmp_path / "w.jsonl", ["w1 w2", "w3"])
    with pytest.raises(UserError, match=r"the tokenizer has no end-of-text token .* set data\.eot \(prepare-data --eot\)"):
        prepare_data([src], tmp_path / "out", tokenizer=str(none))
    with pytest.raises(UserError, match=r"end-of-text token 'w99' \(data\.eot / --eot\) is not a token"):
        prepare_data([src], tmp_path / "out", tokenizer=str(none), eot="w99")
    assert not (tmp_path / "out").exists()
    index = prepare_data([src], tmp_path / "out", tokenizer=str(none), eot="w47", heldout_fraction=0.5)
    assert (index.eot, index.eot_id) == ("w47", 48)
    assert PreparedFolder(tmp_path / "out").tokens.tolist() == [2, 3, 48, 4, 48]
    # training on it: the run's data.eot must agree with the folder's
    with pytest.raises(UserError, match=r"documents end with 'w47', but data\.eot = 'w1'"):
        plan_data(str(tmp_path / "out"), tokenizer=str(none), eot="w1", heldout_fraction=0.5)
    assert plan_data(str(tmp_path / "out"), tokenizer=str(none), heldout_fraction=0.5).eot_id == 48


# ---- reading ----


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 1000, 4097])
def test_permutation_is_a_bijection(n):
    p = Permutation(n, "k")
    got = list(p)
    assert sorted(got) == list(range(n)) and len(p) == n
    assert p[1 % n : 3 % n + 1] == got[1 % n : 3 % n + 1] and p[-1] == got[-1]
    if n >= 64:
        assert got != list(range(n)) and got != list(Permutation(n, "other"))
        assert got == list(Permutation(n, "k"))  # fixed by the key


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    src = _jsonl(root / "c.jsonl", TEXTS * 4)
    prepare_data([src], root / "prep")
    return root / "prep"


def test_order_is_fixed_by_seed_and_epoch(prepared, tok):
    train, _ = load_datasets(str(prepared), tok, 8)
    a = train.order(seed=1, epoch=0)
    assert list(a) == list(train.order(seed=1, epoch=0)) and sorted(a) == list(range(len(train)))
    assert list(a) != list(train.order(seed=2, epoch=0)) and list(a) != list(train.order(seed=1, epoch=1))
    assert a[:5] == [45, 450, 863, 785, 952]  # pinned: hashlib only, stable across platforms


def test_dp_slices_disjoint_and_covering(prepared, tok):
    train, _ = load_datasets(str(prepared), tok, 8)
    one = DataStream(train, 4, seed=5)
    ranks = [DataStream(train, 2, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    seen: list[list[tuple[int, ...]]] = [[], []]
    for _ in range(one.batches_per_epoch):
        x = one.next_batch()[0]
        parts = [s.next_batch()[0] for s in ranks]
        assert torch.equal(torch.cat(parts), x)
        for r, part in enumerate(parts):
            seen[r] += map(tuple, part.tolist())
    used = 4 * one.batches_per_epoch
    want = sorted(map(tuple, train.sequences(list(train.order(5, 0)[:used]))[0].tolist()))
    assert sorted(seen[0] + seen[1]) == want  # together: exactly the epoch's sequences
    assert len(seen[0]) == len(seen[1]) == used // 2


def test_stream_resume_position_exact(prepared, tok):
    train, _ = load_datasets(str(prepared), tok, 8)
    n = len(train) // 4
    ref = DataStream(train, 4, seed=3)
    expected = [ref.next_batch() for _ in range(2 * n + 3)]  # crosses two epoch boundaries
    for stop in (0, 1, n, n + 1, 2 * n):
        first = DataStream(train, 4, seed=3)
        for _ in range(stop):
            first.next_batch()
        state = json.loads(json.dumps(first.state_dict()))
        resumed = DataStream(train, 4, seed=3)
        resumed.load_state_dict(state)
        for i in range(stop, len(expected)):
            got = resumed.next_batch()
            assert torch.equal(got[0], expected[i][0]) and torch.equal(got[1], expected[i][1]), (stop, i)
    packed, _ = load_datasets(str(prepared.parent / "c.jsonl"), tok, 8)
    with pytest.raises(UserError, match="cannot resume the data stream: saved fingerprint"):
        DataStream(packed, 4, seed=3).load_state_dict(DataStream(train, 4, seed=3).state_dict())


def _run_cfg(prepared: Path, steps: int, ck: Path, **extra):
    return load_config().with_overrides(**{
        "data.path": str(prepared), "train.steps": steps, "train.eval_every": 0, "train.checkpoint_every": 3,
        "train.checkpoint_dir": str(ck), **extra})


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny model gains nothing from two, and loses much on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_train_resume_on_prepared_folder_is_exact(prepared, tmp_path, one_thread):
    """6 steps straight vs 3 + a resumed 3 on a prepared folder: equal losses, bit-identical checkpoints."""
    from qeffect.checkpoint import diff_checkpoints
    from qeffect.runtime.train import train

    a = train(_run_cfg(prepared, 6, tmp_path / "a-ck"), out=tmp_path / "a")
    train(_run_cfg(prepared, 3, tmp_path / "b-ck"), out=tmp_path / "b")
    c = train(_run_cfg(prepared, 6, tmp_path / "c-ck"), out=tmp_path / "c", resume=tmp_path / "b-ck")
    assert c.start_step == 3

    def losses(run: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows}

    la, lc = losses(tmp_path / "a"), losses(tmp_path / "c")
    assert sorted(lc) == [4, 5, 6] and [lc[s] for s in (4, 5, 6)] == [la[s] for s in (4, 5, 6)]
    diff = diff_checkpoints(tmp_path / "a-ck" / "step-00000006", tmp_path / "c-ck" / "step-00000006")
    assert diff.identical, diff.model_dump_json(indent=2)[:2000]
    assert a.steps == 6


# ---- checks before any model ----


def test_tokenizer_mismatch_is_one_line(prepared, tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(load_tokenizer().to_str(pretty=True))  # the same vocabulary, other bytes: another sha256
    with pytest.raises(UserError, match=r"tokenized with the bundled tokenizer \(sha256 b856aa4536d8\), but this "
                                        r"run's tokenizer .*other\.json has sha256"):
        plan_data(str(prepared), tokenizer=str(other))
    rc, _, err = _cli(capsys, "train", "--data", str(prepared), "--tokenizer", str(other), "--out",
                      str(tmp_path / "run"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "tokenized with" in err
    assert not (tmp_path / "run").exists()


def test_heldout_fraction_and_path_rules(prepared, tmp_path, tok):
    with pytest.raises(UserError, match=r"prepared with a held-out fraction of 0\.1, but data\.heldout_fraction = 0\.2"):
        plan_data(str(prepared), heldout_fraction=0.2)
    held = _jsonl(tmp_path / "h.jsonl", TEXTS[:8])
    train, heldout = load_datasets(str(prepared), tok, 8, heldout=str(held), heldout_fraction=0.2)
    assert train.num_tokens == PreparedFolder(prepared).index.num_tokens  # all of the folder trains
    assert torch.equal(heldout.tokens, PackedDataset(TEXTS[:8], tok, 8).tokens)
    # JSON lines: the fraction is exact (ceil(30 x 0.1) = 3, not 4), and 0 holds nothing out
    src = _jsonl(tmp_path / "d.jsonl", TEXTS[:30])
    tr, he = load_datasets(str(src), tok, 8)
    assert (tr.num_documents, he.num_documents) == (27, 3)
    tr, he = load_datasets(str(src), tok, 8, heldout_fraction=0.25)
    assert (tr.num_documents, he.num_documents) == (22, 8)
    tr, he = load_datasets(str(src), tok, 8, heldout_fraction=0)
    assert tr.num_documents == 30 and he is None


def test_prepare_bad_inputs_one_line_exit_2_nothing_written(tmp_path, capsys):
    good = _jsonl(tmp_path / "good.jsonl", TEXTS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "one.jsonl").write_text('{"text": "only one"}\n')
    (tmp_path / "data.csv").write_text("a,b\n")
    cases = [
        ([good, tmp_path / "missing.jsonl"], "missing.jsonl: no such file"),
        ([good, bad], "bad.jsonl:3: malformed JSON"),
        ([good, tmp_path / "empty.jsonl"], "empty.jsonl: empty shard"),
        ([tmp_path / "one.jsonl"], "1 document(s) in all: holding out 1"),
        ([good, tmp_path / "data.csv"], "data.csv: unknown kind of input"),
        ([good, tmp_path / "*.nothing"], "no file matches"),
    ]
    out = tmp_path / "sub" / "out"
    for args, needle in cases:
        rc, stdout, err = _cli(capsys, "prepare-data", *map(str, args), "--out", str(out))
        assert rc == 2, (args, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("qeffect: error:") and needle in err, err
        assert not (tmp_path / "sub").exists() and _leftovers(tmp_path) == []
    rc, _, err = _cli(capsys, "prepare-data", str(good), "--out", str(out), "--heldout-fraction", "1")
    assert rc == 2 and "must be at least 0 and below 1" in err


def test_prepare_refuses_non_empty_out_and_overwrites_atomically(tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl", TEXTS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc, _, err = _cli(capsys, "prepare-data", str(src), "--out", str(out))
    assert rc == 2 and "exists and is not empty (--overwrite replaces it)" in err
    assert (out / "keep.txt").exists()
    rc, stdout, _ = _cli(capsys, "prepare-data", str(src), "--out", str(out), "--overwrite", "--json")
    assert rc == 0 and json.loads(stdout)["num_documents"] == 60
    assert sorted(p.name for p in out.iterdir()) == ["documents.npy", "index.json", "tokens.bin"]
    assert _leftovers(tmp_path) == []
    rc, stdout, _ = _cli(capsys, "prepare-data", str(src), "--out", str(tmp_path / "o2"))
    assert rc == 0 and "60 documents" in stdout and "held out" in stdout
    assert (tmp_path / "o2" / "tokens.bin").read_bytes() == (out / "tokens.bin").read_bytes()  # deterministic


def test_damaged_folder_is_one_line(prepared, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    with open(copy / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match=r"tokens\.bin: 100 bytes, the index says .* \(truncated or modified"):
        plan_data(str(copy))
    index = json.loads((prepared / "index.json").read_text())
    (copy / "index.json").write_text(json.dumps({**index, "version": 9}))
    with pytest.raises(UserError, match=r"index\.json: format version 9; this qeffect reads version 1"):
        plan_data(str(copy))
    (copy / "index.json").write_text(json.dumps({**index, "num_tokens": "many"}))
    with pytest.raises(UserError, match=r"index\.json: malformed index: num_tokens"):
        plan_data(str(copy))
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserError, match=r"plain: is a folder without index\.json"):
        plan_data(str(tmp_path / "plain"))


def test_data_is_checked_before_any_model_is_built(prepared, tmp_path, monkeypatch):
    import qeffect.runtime.train as T

    def no_model(*a, **k):
        raise AssertionError("the model was built before the data check")

    monkeypatch.setattr(T, "build_single_process", no_model)
    with pytest.raises(UserError, match=r"nonexistent: no such file"):
        T.train(load_config().with_overrides(**{"data.path": str(tmp_path / "nonexistent")}), out=tmp_path / "r")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:2: malformed JSON"):
        T.train(load_config().with_overrides(**{"data.path": str(bad)}), out=tmp_path / "r")
    with pytest.raises(UserError, match=r"data\.heldout_fraction = 0\.3"):
        T.train(load_config().with_overrides(**{"data.path": str(prepared), "data.heldout_fraction": 0.3}),
                out=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_train_nonexistent_data_fails_before_importing_the_training_runtime(tmp_path):
    """`qeffect train` checks the data before it imports `qeffect.runtime.train` (and so the pipeline)."""
    code = ("import sys, time; t = time.perf_counter()\n"
            "from qeffect.cli.app import main\n"
            "try:\n    main(['train', '--data', '/nonexistent', '--out', sys.argv[1]])\n"
            "except SystemExit as e:\n"
            "    print(e.code, 'qeffect.runtime.train' in sys.modules, round(time.perf_counter() - t, 2))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="200"))
    rc, runtime_imported, seconds = proc.stdout.split()
    assert (rc, runtime_imported) == ("2", "False"), proc.stderr
    assert proc.stderr.strip() == "qeffect: error: /nonexistent: no such file"
    print(f"train --data /nonexistent: exit 2 after {seconds} s in main()")
    assert not (tmp_path / "run").exists()
