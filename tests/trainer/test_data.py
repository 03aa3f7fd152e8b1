"""fxshard.trainer.data: files -> tokens -> windows -> each dp rank's rows, on real text.

The text is the shipped Genesis (examples/data/genesis.txt); the tokenizers are the
byte-level one and a BPE trained on that text (merges make the joins of pieces matter).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fxshard.trainer import data
from fxshard.trainer.data import (PackedTokens, TextBatches, TokenFile, byte_level_tokenizer, eval_batches,
                                  load_tokenizer, resolve_files, tokenize_files)
from fxshard.trainer.errors import TrainerError
from fxshard.testing.hf_checkpoints import make_hf_checkpoint, train_byte_level_bpe

from harness import spawn

GENESIS = Path(__file__).resolve().parents[2] / "examples" / "data" / "genesis.txt"
GENESIS_EVAL = GENESIS.with_name("genesis.eval.txt")


@pytest.fixture(scope="module")
def chapters() -> list[str]:
    """Genesis 1..45, one string per chapter (heading, blank line, verses)."""
    text = GENESIS.read_text(encoding="utf-8")
    parts = text.split("Genesis ")[1:]
    return ["Genesis " + p for p in parts]


@pytest.fixture(scope="module")
def bpe():
    return train_byte_level_bpe([GENESIS], vocab_size=512)


@pytest.fixture(scope="module")
def byte_tok():
    return byte_level_tokenizer()


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def tokens_of(tf: TokenFile) -> list[int]:
    return np.fromfile(tf.path, dtype=tf.dtype).tolist()


def write_text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8", newline="")
    return path


# ----------------------------------------------------------------------------- tokenization

def test_txt_files_tokenize_as_whole_documents_with_eos_after_each(tmp_path, monkeypatch, chapters):
    """A .txt file is one document, streamed in pieces (made small here) that join without seams."""
    monkeypatch.setattr(data, "PIECE_CHARS", 300)
    monkeypatch.setattr(data, "BATCH_CHARS", 2000)
    calls = []
    real_encode = data._encode
    monkeypatch.setattr(data, "_encode", lambda tok, texts: calls.append(len(texts)) or real_encode(tok, texts))
    # blank lines, indented lines and trailing spaces: the joints a cut must avoid
    odd = "".join(f"  {line}  \n\n" if i % 3 == 0 else line + "\n" for i, line in enumerate(chapters[1].splitlines()))
    docs = ["".join(chapters[:3]), odd, "no newline at the end"]
    files = [write_text(tmp_path / f"doc{i}.txt", d) for i, d in enumerate(docs)]
    bpe = train_byte_level_bpe(files, vocab_size=1024)  # with merges of runs of spaces and newlines
    assert {"ĠĠ", "ĊĊ", "ĊĠ"} <= set(bpe.get_vocab())
    tf = tokenize_files(files, bpe, cache_dir=tmp_path / "cache")
    expected = [i for d in docs for i in ids_of(bpe, d) + [bpe.eos_token_id]]
    assert tokens_of(tf) == expected
    assert sum(calls) > len(docs) + 5, "the documents were not cut into pieces"
    assert tf.num_tokens == len(expected) and tf.dtype == "uint16"


def test_records_of_jsonl_json_parquet_are_documents_in_file_order(tmp_path, chapters, bpe):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = chapters[:7]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs[:2])))
    write_text(tmp_path / "b.txt", docs[2])
    pq.write_table(pa.table({"body": [docs[3], "", docs[4]], "n": [1, 2, 3]}), tmp_path / "c.parquet")
    (tmp_path / "d.json").write_text(json.dumps([{"body": d} for d in docs[5:]]))
    files = [tmp_path / n for n in ("a.jsonl", "b.txt", "c.parquet", "d.json")]
    tf = tokenize_files(files, bpe, cache_dir=tmp_path / "cache", text_field="body")
    # the empty record is no document: no lone EOS
    assert tokens_of(tf) == [i for d in docs for i in ids_of(bpe, d) + [bpe.eos_token_id]]


def test_reading_files_asks_the_network_nothing(tmp_path, monkeypatch, byte_tok):
    """datasets' loaders send the Hub a download count unless offline: the trainer keeps them offline."""
    import socket

    asked = []

    def refuse(*args, **kwargs):
        asked.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    tokenize_files([tmp_path / "a.jsonl", GENESIS_EVAL], byte_tok, cache_dir=tmp_path / "cache")
    assert asked == []


def test_directories_and_globs_name_their_data_files_sorted(tmp_path):
    for name in ("b.txt", "a.jsonl", "sub/c.parquet", "README.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    assert [p.name for p in resolve_files(tmp_path)] == ["a.jsonl", "b.txt", "c.parquet"]
    assert [p.name for p in resolve_files([str(tmp_path / "*.txt"), tmp_path / "a.jsonl"])] == ["b.txt", "a.jsonl"]


# ----------------------------------------------------------------------------- windows and batches

@pytest.fixture(scope="module")
def genesis_tokens(tmp_path_factory, byte_tok):
    cache = tmp_path_factory.mktemp("cache")
    return PackedTokens.from_files(GENESIS, byte_tok, seq_len=64, cache_dir=cache)


def test_windows_overlap_by_one_and_labels_are_pre_shifted(genesis_tokens):
    raw = list(GENESIS.read_bytes()) + [256]  # byte-level: the ids are the bytes, then EOS
    t = genesis_tokens
    assert t.num_tokens == len(raw) and len(t) == (len(raw) - 1) // 64
    assert isinstance(t.tokens, np.memmap) and t.tokens.mode == "r"  # read when asked, never whole
    last = len(t) - 1
    input_ids, labels = t.batch([0, 7, last])
    assert input_ids.dtype == labels.dtype == torch.int64 and input_ids.shape == labels.shape == (3, 64)
    for row, i in enumerate([0, 7, last]):
        assert input_ids[row].tolist() == raw[i * 64:i * 64 + 64]
        assert labels[row].tolist() == raw[i * 64 + 1:i * 64 + 65]


def _rows(batches: TextBatches, steps: int) -> list[list[int]]:
    """The windows each step reads on this rank (the first token of each row tells it)."""
    out = []
    for _ in range(steps):
        ids, _ = batches.next_batch()
        out.append(ids[:, 0].tolist())
    return out


def _windows_read(tokens, steps, **kw):
    b = TextBatches(tokens, **kw)
    return [[b.window_of_row(g) for g in range(s * b.global_batch, (s + 1) * b.global_batch)] for s in range(steps)]


def test_shuffled_order_is_fixed_by_the_seed_and_new_each_epoch(genesis_tokens):
    n = len(genesis_tokens)
    a = TextBatches(genesis_tokens, 8, seed=1)
    epoch0 = [a.window_of_row(g) for g in range(n)]
    epoch1 = [a.window_of_row(g) for g in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))  # each epoch reads every window once
    assert epoch0 != epoch1 and epoch0 != list(range(n))
    again = TextBatches(genesis_tokens, 8, seed=1)
    assert [again.window_of_row(g) for g in range(2 * n)] == epoch0 + epoch1
    other = TextBatches(genesis_tokens, 8, seed=2)
    assert [other.window_of_row(g) for g in range(n)] != epoch0
    ordered = TextBatches(genesis_tokens, 8, shuffle=False)
    assert [ordered.window_of_row(g) for g in range(n + 3)] == list(range(n)) + [0, 1, 2]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_shares_of_a_step_make_the_one_rank_global_batch(tmp_path, byte_tok, dp):
    # a short corpus (43 windows), so that steps cross epochs
    tokens = PackedTokens.from_files(GENESIS_EVAL, byte_tok, seq_len=512, cache_dir=tmp_path)
    whole = TextBatches(tokens, 8, seed=3)
    ranks = [TextBatches(tokens, 8, seed=3, dp_rank=r, dp_size=dp) for r in range(dp)]
    for _ in range(12):
        ids, labels = whole.next_batch()
        shares = [b.next_batch() for b in ranks]
        assert all(s[0].shape == (8 // dp, 512) for s in shares)
        assert torch.equal(torch.cat([s[0] for s in shares]), ids)
        assert torch.equal(torch.cat([s[1] for s in shares]), labels)
    assert ranks[-1].position == whole.position == 96 and whole.epoch == pytest.approx(96 / len(tokens))


def test_resume_reads_what_the_uninterrupted_loader_reads(tmp_path, genesis_tokens):
    straight = TextBatches(genesis_tokens, 16, seed=5, dp_rank=1, dp_size=2)
    expected = _rows(straight, 7)
    first = TextBatches(genesis_tokens, 16, seed=5, dp_rank=1, dp_size=2)
    assert _rows(first, 3) == expected[:3]
    torch.save(first.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # plain types only
    assert state == {"position": 48, "digest": genesis_tokens.digest}
    assert type(state["position"]) is int and type(state["digest"]) is str
    resumed = TextBatches(genesis_tokens, 16, seed=5, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    assert _rows(resumed, 4) == expected[3:]
    # the position counts global rows: a run may resume at another dp size
    one_rank = TextBatches(genesis_tokens, 16, seed=5)
    one_rank.load_state_dict(state)
    assert _rows(one_rank, 1)[0][8:] == expected[3]


def test_eval_batches_read_the_windows_in_order(tmp_path, byte_tok):
    tokens = PackedTokens.from_files(GENESIS_EVAL, byte_tok, seq_len=256, cache_dir=tmp_path)
    n = len(tokens)
    first = [ids[:, 0].tolist() for ids, _ in eval_batches(tokens, 8, dp_rank=1, dp_size=2, max_batches=3)]
    assert first == [[tokens.window(w)[0] for w in range(s * 8 + 4, s * 8 + 8)] for s in range(3)]
    assert len(list(eval_batches(tokens, 8))) == n // 8  # all full batches, no wrap-around


# ----------------------------------------------------------------------------- the cache

def test_token_file_is_built_once_and_reused(tmp_path, monkeypatch, chapters, byte_tok):
    f = write_text(tmp_path / "book.txt", "".join(chapters[:2]))
    cache = tmp_path / "cache"
    tf = tokenize_files(f, byte_tok, cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == [f"{tf.key}.bin", f"{tf.key}.json"]  # no leftovers

    def no_build(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data, "_build", no_build)
    assert tokenize_files(f, byte_tok, cache_dir=cache) == tf
    assert PackedTokens.from_files(f, byte_tok, 64, cache_dir=cache).digest == f"{tf.digest}-seq64"
    monkeypatch.undo()
    # the same text under another name: another cache entry, the same content digest
    copy = write_text(tmp_path / "copy.txt", f.read_text())
    tf_copy = tokenize_files(copy, byte_tok, cache_dir=cache)
    assert tf_copy.key != tf.key and tf_copy.digest == tf.digest
    # a changed file: a new key and a new digest
    write_text(f, "".join(chapters[:3]))
    os.utime(f, ns=(tf.path.stat().st_mtime_ns + 10**9,) * 2)
    changed = tokenize_files(f, byte_tok, cache_dir=cache)
    assert changed.key != tf.key and changed.digest != tf.digest
    # another tokenizer or text field: another key
    digests = [data.file_digest(f)]
    assert data._cache_key([f], byte_tok, "text", digests) == changed.key
    assert data._cache_key([f], train_byte_level_bpe([f], 300), "text", digests) != changed.key
    assert data._cache_key([f], byte_tok, "body", digests) != changed.key


def test_a_failed_build_leaves_nothing_that_looks_finished(tmp_path, monkeypatch, chapters, byte_tok):
    monkeypatch.setattr(data, "PIECE_CHARS", 100)
    monkeypatch.setattr(data, "BATCH_CHARS", 1000)
    real_encode, calls = data._encode, []

    def dies(tok, texts):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_encode(tok, texts)

    monkeypatch.setattr(data, "_encode", dies)
    f = write_text(tmp_path / "book.txt", "".join(chapters[:4]))
    with pytest.raises(KeyboardInterrupt):
        tokenize_files(f, byte_tok, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    assert tokenize_files(f, byte_tok, cache_dir=tmp_path / "cache").num_tokens == len(f.read_bytes()) + 1


def _rank_zero_builds(rank, world_size, files, cache):
    if rank != 0:
        def no_build(*a, **k):
            raise AssertionError(f"rank {rank} tokenized")
        data._build = no_build
    tf = tokenize_files(files, byte_level_tokenizer(), cache_dir=cache)
    assert tf.num_tokens == sum(os.path.getsize(f) + 1 for f in files)
    if rank != 0:  # rank 0 fails (a missing text field): the others pass the barrier and say so
        with pytest.raises(TrainerError, match="rank 0 did not leave the token file"):
            tokenize_files(files, byte_level_tokenizer(), cache_dir=cache + "-other")
    else:
        with pytest.raises(TrainerError, match="no field"):
            tokenize_files(files + [_bad_jsonl(cache)], byte_level_tokenizer(), cache_dir=cache + "-other")


def _bad_jsonl(cache):
    path = Path(cache).parent / "bad.jsonl"
    path.write_text('{"body": "x"}\n')
    return str(path)


def test_under_torch_distributed_rank_zero_builds_and_the_others_wait(tmp_path):
    spawn(_rank_zero_builds, 2, [str(GENESIS_EVAL)], str(tmp_path / "cache"), timeout=120)


# ----------------------------------------------------------------------------- tokenizers

def test_byte_level_tokenizer_is_the_bytes_and_saves_with_save_pretrained(tmp_path, byte_tok):
    from transformers import AutoTokenizer

    text = "In the beginning — «Génesis» 1:1\n\ttabs, 日本語 and 🙂"
    ids = ids_of(byte_tok, text)
    assert ids == list(text.encode("utf-8"))
    assert byte_tok.decode(ids) == text
    assert byte_tok.eos_token_id == 256 and len(byte_tok) == 257
    byte_tok.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok", vocab_size=257)  # tokenizer files: loaded, not rebuilt
    assert ids_of(loaded, text) == ids and loaded.eos_token_id == 256
    assert ids_of(AutoTokenizer.from_pretrained(tmp_path / "tok"), text) == ids


def test_load_tokenizer_falls_back_to_bytes_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for model_dir in (None, tmp_path):
        tok = load_tokenizer(model_dir, vocab_size=300)
        assert tok.eos_token_id == 256 and ids_of(tok, "ab") == [97, 98]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_make_hf_checkpoint_loads_as_a_user_checkpoint(tmp_path, model_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_hf_checkpoint(tmp_path / "ckpt", model_type, text_files=[GENESIS], vocab_size=384)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == model_type and model.config.vocab_size == 384
    assert model.config.eos_token_id == model.config.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(
        "<|endoftext|>")
    assert (path / "model.safetensors").is_file()
    text = "And God said, Let there be light"
    assert tok.decode(ids_of(tok, text)) == text and len(ids_of(tok, text)) < len(text) / 2  # merges learned
    ours = load_tokenizer(path, model.config.vocab_size)
    ids = torch.tensor([ids_of(ours, text)])
    assert ids.tolist() == [ids_of(tok, text)]
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


# ----------------------------------------------------------------------------- user errors

def test_bad_inputs_are_trainer_errors_that_say_the_fix(tmp_path, monkeypatch, bpe, byte_tok, genesis_tokens):
    def raises(match, fn, *a, **k):
        with pytest.raises(TrainerError, match=match) as e:
            fn(*a, **k)
        assert "fix:" in str(e.value)

    raises("does not exist", resolve_files, tmp_path / "nope.txt")
    (tmp_path / "a.csv").write_text("text\nx\n")
    raises(r"unknown extension '\.csv'", resolve_files, tmp_path / "a.csv")
    raises("matches no file", resolve_files, str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    raises("holds no", resolve_files, tmp_path / "empty")
    # vocabularies
    raises("vocab_size is 256.*257", load_tokenizer, None, 256)
    bpe.save_pretrained(tmp_path / "ckpt")
    raises("ids up to 511.*vocab_size is 300", load_tokenizer, tmp_path / "ckpt", 300)
    no_eos = train_byte_level_bpe([GENESIS], 300)
    no_eos.eos_token = None
    no_eos.save_pretrained(tmp_path / "no_eos")
    raises("no EOS token", load_tokenizer, tmp_path / "no_eos", 300)
    # records
    (tmp_path / "r.jsonl").write_text('{"body": "x"}\n')
    raises("no field 'text'.*body", tokenize_files, tmp_path / "r.jsonl", bpe, cache_dir=tmp_path / "c")
    (tmp_path / "n.jsonl").write_text('{"text": 5}\n')
    raises("is int, not text", tokenize_files, tmp_path / "n.jsonl", bpe, cache_dir=tmp_path / "c")
    # sizes
    short = write_text(tmp_path / "short.txt", "In the beginning")
    raises("17 tokens.*seq_len 64", PackedTokens.from_files, short, byte_tok, 64, cache_dir=tmp_path / "c")
    raises("does not split over 3", TextBatches, genesis_tokens, 8, dp_size=3)
    raises("fewer than one global batch", lambda: next(eval_batches(genesis_tokens, len(genesis_tokens) + 1)))
    # resuming on other data (here: other windows of the same tokens)
    other = PackedTokens(genesis_tokens.token_file, seq_len=32)
    raises("other data", TextBatches(other, 8).load_state_dict, TextBatches(genesis_tokens, 8).state_dict())


# ----------------------------------------------------------------------------- the cache, tampered with

def _built(monkeypatch) -> list[int]:
    """Counts the builds of the token file from now on."""
    builds, real = [], data._build
    monkeypatch.setattr(data, "_build", lambda *a, **k: builds.append(1) or real(*a, **k))
    return builds


def test_text_changed_with_its_mtime_kept_is_tokenized_again(tmp_path, monkeypatch, chapters, byte_tok):
    """``cp -p`` / ``rsync -t`` / tar: same size, same mtime, other bytes. The content digest sees it."""
    f = write_text(tmp_path / "book.txt", chapters[0])
    cache = tmp_path / "cache"
    first = tokenize_files(f, byte_tok, cache_dir=cache)
    stat = f.stat()
    swapped = chapters[0].replace("God", "Dog")  # the same length
    assert len(swapped) == len(chapters[0]) and swapped != chapters[0]
    write_text(f, swapped)
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    builds = _built(monkeypatch)
    again = tokenize_files(f, byte_tok, cache_dir=cache)
    assert builds == [1] and again.key != first.key and again.digest != first.digest
    assert tokens_of(again) == ids_of(byte_tok, swapped) + [byte_tok.eos_token_id]
    assert tokenize_files(f, byte_tok, cache_dir=cache) == again and builds == [1], "an unchanged file is reused"
    assert json.loads(again.path.with_suffix(".json").read_text())["files"][0]["blake2b"] == data.file_digest(f)


@pytest.mark.parametrize("tamper", ["object dtype", "float dtype", "count as text", "sidecar not json",
                                    "truncated tokens", "flipped token byte", "sidecar of another key"])
def test_a_tampered_cache_entry_is_built_again_never_read(tmp_path, monkeypatch, chapters, byte_tok, tamper):
    """A sidecar saying ``"dtype": "object"`` once made numpy read file bytes as object pointers
    (a segfault). Every tampering is caught before a byte is read as tokens: the entry is built
    again, and opening it directly is a TrainerError naming the file."""
    f = write_text(tmp_path / "book.txt", "".join(chapters[:2]))
    cache = tmp_path / "cache"
    good = tokenize_files(f, byte_tok, cache_dir=cache)
    want = tokens_of(good)
    meta_path = good.path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    if tamper == "object dtype":
        meta["dtype"] = "object"
    elif tamper == "float dtype":
        meta["dtype"] = "float64"
    elif tamper == "count as text":
        meta["num_tokens"] = str(meta["num_tokens"])
    elif tamper == "sidecar of another key":
        meta["key"] = "0" * 24
    if tamper == "sidecar not json":
        meta_path.write_text('{"dtype": "uint16", ')
    else:
        meta_path.write_text(json.dumps(meta))
    raw = good.path.read_bytes()
    if tamper == "truncated tokens":
        good.path.write_bytes(raw[:-2])
    elif tamper == "flipped token byte":
        good.path.write_bytes(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])
    if tamper not in ("flipped token byte", "sidecar of another key"):  # sound as a file: the cache's checks tell
        with pytest.raises(TrainerError, match=f"token file {good.path}.*\n  fix:"):
            TokenFile.open(good.path)
    builds = _built(monkeypatch)
    again = tokenize_files(f, byte_tok, cache_dir=cache)
    assert builds == [1], f"{tamper}: the entry was reused"
    assert again == good and tokens_of(again) == want
    assert sorted(p.name for p in cache.iterdir()) == [f"{good.key}.bin", f"{good.key}.json"]


def test_a_token_file_of_another_dtype_is_refused_by_packed_tokens(tmp_path, chapters, byte_tok):
    f = write_text(tmp_path / "book.txt", chapters[0])
    tf = tokenize_files(f, byte_tok, cache_dir=tmp_path / "cache")
    import dataclasses

    with pytest.raises(TrainerError, match="'object' do not match the file"):
        PackedTokens(dataclasses.replace(tf, dtype="object"), seq_len=16)
    with pytest.raises(TrainerError, match="do not match the file"):
        PackedTokens(dataclasses.replace(tf, num_tokens=tf.num_tokens + 1), seq_len=16)


# ----------------------------------------------------------------------------- records: only the text field

def test_records_with_other_fields_that_differ_are_read_by_their_text_field(tmp_path, chapters, bpe):
    """A new user's corpus: .jsonl records with extra fields that differ from record to record
    and from file to file (datasets said KeyError: 'source' and CastError), parquet files whose
    other columns differ, a .json array: only --text-field is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = chapters[:8]
    (tmp_path / "a.jsonl").write_text("\n".join([
        json.dumps({"body": docs[0], "source": "web"}),
        json.dumps({"id": 7, "body": docs[1], "meta": {"lang": "en"}}),
        "",  # a blank line is no record
        json.dumps({"body": docs[2], "source": ["a", 1], "score": 0.5})]) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": docs[3], "n": "x"}) + "\n" + json.dumps({"body": docs[4]}) + "\n")
    pq.write_table(pa.table({"body": [docs[5]], "n": [1]}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"other": [2.0], "body": [docs[6]]}), tmp_path / "d.parquet")
    (tmp_path / "e.json").write_text(json.dumps([{"body": docs[7], "x": 1}, {"body": "", "y": [2]}]))
    files = [tmp_path / n for n in ("a.jsonl", "b.jsonl", "c.parquet", "d.parquet", "e.json")]
    tf = tokenize_files(files, bpe, cache_dir=tmp_path / "cache", text_field="body")
    assert tokens_of(tf) == [i for d in docs for i in ids_of(bpe, d) + [bpe.eos_token_id]]


def test_a_record_without_the_text_field_is_named_by_file_and_line(tmp_path, bpe):
    bad = tmp_path / "mixed.jsonl"
    bad.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"title": "b", "source": "c"}) + "\n")
    with pytest.raises(TrainerError, match=f"{bad} line 2: the record has no field 'text' \\(its fields: title, source\\)"):
        tokenize_files(bad, bpe, cache_dir=tmp_path / "c")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(TrainerError, match=f"{broken} line 2: not JSON"):
        tokenize_files(broken, bpe, cache_dir=tmp_path / "c")
    (tmp_path / "list.jsonl").write_text('["text"]\n')
    with pytest.raises(TrainerError, match="line 1: a list, not a record"):
        tokenize_files(tmp_path / "list.jsonl", bpe, cache_dir=tmp_path / "c")
