"""The trainer's text data: local files -> tokens -> packed windows -> each dp rank's rows.

Four steps, each one object::

    tok = load_tokenizer("ckpt/", vocab_size=32000)        # the checkpoint's, or byte-level
    tokens = PackedTokens.from_files(["book.txt"], tok, seq_len=256, cache_dir="~/.cache/fxshard/tokens")
    batches = TextBatches(tokens, global_batch=32, seed=0, dp_rank=r, dp_size=4)
    input_ids, labels = batches.next_batch()             # [8, 256] each: this rank's quarter of step 0

- **Files** (:func:`resolve_files`): ``.txt`` (a file is one document), ``.jsonl`` / ``.json``
  and ``.parquet`` (a record's text field is one document); files, directories or globs.
  A ``.txt`` file is read with ``datasets.load_dataset`` (Arrow, memory-mapped); ``.jsonl``
  records are read a line at a time and parquet files a batch of the one column at a time,
  only the text field of each record: records with other fields besides it are fine, and
  a corpus larger than memory is never held whole (a ``.json`` array is read whole).
- **Tokens** (:func:`tokenize_files`): each document tokenized without special tokens and
  followed by the EOS token, written once to a flat file of uint16 (uint32 when the
  vocabulary needs it) in the cache directory, keyed by the files' paths and content
  digests (blake2b, read streaming), the tokenizer and the text field. A cache entry is
  checked before use (its dtype one the writer writes, its length, its own digest); one
  that fails is built again, never read. Under torch.distributed global rank 0 hashes,
  checks and writes it and the others wait for the name it sends.
- **Windows** (:class:`PackedTokens`): window ``i`` is tokens ``[i*seq, i*seq + seq + 1)``;
  the labels are pre-shifted (``input_ids = w[:-1]``, ``labels = w[1:]``), so the loss is
  the cross-entropy of the logits at t against the labels at t.
- **Rows** (:class:`TextBatches`): global row ``g`` is window ``perm_e[g % n]`` with a
  permutation per epoch ``e = g // n`` fixed by the seed; step k's global batch is rows
  ``[k*B, (k+1)*B)`` and dp rank r reads its contiguous ``B/dp`` of them. The state is the
  count of global rows consumed, so a run resumes exactly, also at another dp size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from fxshard.trainer.errors import TrainerError

__all__ = ["DEFAULT_CACHE_DIR", "EXTENSIONS", "EOS_TOKEN", "TOKEN_DTYPES", "load_tokenizer", "byte_level_tokenizer",
           "eos_token_id", "resolve_files", "tokenize_files", "file_digest", "TokenFile", "PackedTokens", "TextBatches",
           "eval_batches"]

DEFAULT_CACHE_DIR = "~/.cache/fxshard/tokens"
EOS_TOKEN = "<|endoftext|>"
# extension -> the kind of file: "text" (datasets' text builder, a file is a document) or records
EXTENSIONS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# files a checkpoint's tokenizer is saved as (any one is enough for AutoTokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# bump when the token file's layout or the tokenization rules change: old caches are then not reused
CACHE_FORMAT = 2
# the dtypes a token file may hold: what _build writes (uint16, uint32) and plain integer ids; any
# other name in a sidecar (say "object", which would read file bytes as object pointers) is refused
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
HASH_CHUNK = 1 << 20  # bytes read at a time when hashing a file
# a .txt document is tokenized in pieces of about this many characters, cut where a cut
# changes no token (_safe_cut), and pieces are encoded this many characters at a time
# (one batch call: the Rust tokenizer spreads it over the cores)
PIECE_CHARS = 1 << 16
BATCH_CHARS = 1 << 22


# ----------------------------------------------------------------------------- tokenizer

def byte_level_tokenizer():
    """A tokenizer whose ids 0..255 are the bytes of the UTF-8 text and 256 is ``<|endoftext|>``.

    A real ``tokenizers`` ByteLevel BPE with no merges wrapped as a
    ``PreTrainedTokenizerFast``: it saves with ``save_pretrained`` and loads back with
    ``AutoTokenizer``, so it ships with the trained model.

    Example::

        tok = byte_level_tokenizer()
        tok("hé", add_special_tokens=False)["input_ids"]   # [104, 195, 169]
        tok.eos_token_id                                    # 256
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])  # id 256: after the 256 bytes
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what ByteLevel's pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def load_tokenizer(model_dir: str | os.PathLike | None, vocab_size: int):
    """The tokenizer of the checkpoint in ``model_dir``, or :func:`byte_level_tokenizer` when
    there is none (no directory, or no tokenizer files in it); checked against the model's
    ``vocab_size`` and for an EOS token.

    Example::

        tok = load_tokenizer(None, vocab_size=512)       # byte-level: ids 0..256
        tok = load_tokenizer("ckpt/", vocab_size=32000)  # AutoTokenizer.from_pretrained("ckpt/")
    """
    if model_dir is not None and any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - a broken checkpoint is the user's input
            raise TrainerError(f"the tokenizer in {model_dir} does not load: {type(e).__name__}: {e}\n"
                               f"  fix: repair or remove its tokenizer files") from e
        source = f"the tokenizer of {model_dir}"
    else:
        if vocab_size < 257:
            raise TrainerError(
                f"the model's vocab_size is {vocab_size}, and {model_dir or 'no checkpoint'} has no tokenizer: "
                f"the byte-level tokenizer needs 257 ids (256 bytes and the end-of-text token)\n"
                f"  fix: a vocab_size of 257 or more, or a checkpoint directory with a tokenizer")
        tokenizer = byte_level_tokenizer()
        source = "the byte-level tokenizer"
    top = max(tokenizer.get_vocab().values())
    if top >= vocab_size:
        raise TrainerError(f"{source} has ids up to {top}, and the model's vocab_size is {vocab_size}\n"
                           f"  fix: a vocab_size of {top + 1} or more, or the tokenizer the model was made with")
    eos_token_id(tokenizer, source)
    return tokenizer


def eos_token_id(tokenizer, source: str = "the tokenizer") -> int:
    """The id that ends each document: the tokenizer's ``eos_token_id`` (a TrainerError if none).

    Example::

        eos_token_id(byte_level_tokenizer())   # 256
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise TrainerError(f"{source} has no EOS token, and documents are joined with it\n"
                           f"  fix: set eos_token in its tokenizer_config.json, or use a tokenizer that has one")
    return int(eos)


def _tokenizer_fingerprint(tokenizer) -> str:
    """Everything that decides the token ids: the serialized tokenizer (or its vocabulary) and EOS."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return f"{type(tokenizer).__name__}\n{tokenizer.eos_token_id}\n{body}"


# ----------------------------------------------------------------------------- files

def resolve_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The data files named by ``paths``: files, directories (their data files, recursively,
    sorted) or globs; each of a known extension (:data:`EXTENSIONS`).

    Example::

        resolve_files(["examples/data/genesis.txt", "more/*.jsonl"])
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for given in paths:
        path = Path(given).expanduser()
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in EXTENSIONS)
            if not found:
                raise TrainerError(f"data directory {given} holds no {', '.join(EXTENSIONS)} file\n"
                                   f"  fix: name the files, or put the text in one of these formats")
        elif glob.has_magic(str(path)):
            found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not found:
                raise TrainerError(f"data pattern {given} matches no file\n  fix: check the pattern")
        else:
            raise TrainerError(f"data file {given} does not exist\n  fix: check the path")
        for file in found:
            if file.suffix not in EXTENSIONS:
                raise TrainerError(f"data file {file}: unknown extension {file.suffix!r}; "
                                   f"the trainer reads {', '.join(EXTENSIONS)}\n"
                                   f"  fix: rename it, or convert it to one of these")
        files += found
    if not files:
        raise TrainerError("no data files given\n  fix: name at least one .txt, .jsonl, .json or .parquet file")
    return [f.resolve() for f in files]


# ----------------------------------------------------------------------------- the token file

@dataclasses.dataclass(frozen=True)
class TokenFile:
    """A finished token file: ``path`` (raw ``dtype`` ids), its ``num_tokens``, the
    ``digest`` of its content (what resuming checks) and the cache ``key`` it was built under.

    Example::

        tf = tokenize_files(["book.txt"], tok, cache_dir="/tmp/tok")
        np.memmap(tf.path, dtype=tf.dtype, mode="r")    # the ids
    """
    path: Path
    dtype: str
    num_tokens: int
    digest: str
    key: str

    @classmethod
    def open(cls, path: str | os.PathLike) -> "TokenFile":
        """The token file at ``path``, its ``.json`` sidecar checked (a dtype of
        :data:`TOKEN_DTYPES`, a count that is the file's length); a TrainerError naming the
        file otherwise, so a tampered or truncated cache is never read."""
        path = Path(path)
        problem, meta = _sidecar_problem(path)
        if problem:
            raise TrainerError(f"token file {path}: {problem}\n  fix: delete it and its .json (the trainer "
                               f"tokenizes the text again), or point --data-cache at another directory")
        return cls(path, meta["dtype"], meta["num_tokens"], meta["digest"], meta["key"])


def _sidecar_problem(bin_path: Path, key: str | None = None) -> tuple[str | None, dict]:
    """What is wrong with a token file and its sidecar (``None``: nothing), and the sidecar.

    Checked without reading the tokens: the sidecar is JSON with the fields the writer writes,
    its dtype one of :data:`TOKEN_DTYPES` (a name numpy would read as anything else, say
    ``object``, is never handed to it), its count a non-negative int that times the dtype's
    size is the file's length, and (``key``) the key it was built under."""
    meta_path = bin_path.with_suffix(".json")
    if not bin_path.is_file() or not meta_path.is_file():
        return "missing (or not a regular file)", {}
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"its sidecar {meta_path.name} does not read as JSON ({e})", {}
    if not isinstance(meta, dict):
        return f"its sidecar {meta_path.name} is not a JSON object", {}
    dtype, count = meta.get("dtype"), meta.get("num_tokens")
    if dtype not in TOKEN_DTYPES:
        return f"its sidecar says dtype {dtype!r}; a token file holds {', '.join(TOKEN_DTYPES)}", meta
    if type(count) is not int or count < 0:
        return f"its sidecar's num_tokens {count!r} is not a count", meta
    if not isinstance(meta.get("digest"), str) or not isinstance(meta.get("key"), str):
        return "its sidecar has no digest or key", meta
    if key is not None and meta["key"] != key:
        return f"its sidecar was written for key {meta['key']!r}, not {key!r}", meta
    size, want = bin_path.stat().st_size, count * np.dtype(dtype).itemsize
    if size != want:
        return f"{size} bytes where its sidecar's {count} {dtype} tokens take {want} (truncated or changed)", meta
    return None, meta


def tokenize_files(files, tokenizer, *, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
                   text_field: str = "text") -> TokenFile:
    """The tokens of ``files`` (see :func:`resolve_files`), each document followed by EOS, in
    a token file under ``cache_dir``; built once, then reused while the files (their paths and
    contents: a blake2b digest of each, so a text changed with its mtime kept is seen), the
    tokenizer and ``text_field`` stay the same. A cache entry that does not check out (its
    sidecar's dtype or count, its length, its own content digest) is built again.

    Under torch.distributed global rank 0 hashes the files and builds (or checks) the token
    file while the other ranks wait for its key, so ``cache_dir`` must be a directory every
    rank sees.

    Example::

        tf = tokenize_files("examples/data/genesis.txt", byte_level_tokenizer(), cache_dir="/tmp/tok")
        tf.num_tokens     # 177347: the bytes of the file, then one EOS
    """
    files = resolve_files(files)
    eos = eos_token_id(tokenizer)
    cache = Path(cache_dir).expanduser()

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        failure, key = None, None
        try:
            sources = [_source_record(f) for f in files]
            key = _cache_key(files, tokenizer, text_field, [s["blake2b"] for s in sources])
            bin_path = cache / f"{key}.bin"
            if not _reusable(bin_path, key):
                cache.mkdir(parents=True, exist_ok=True)
                _build(files, tokenizer, eos, text_field, cache, bin_path, key, sources)
        except BaseException as e:  # the other ranks wait for the key: send them none, then fail here
            failure, key = e, None
        if distributed:
            torch.distributed.broadcast_object_list([key], src=0)
        if failure is not None:
            raise failure
    else:
        sent = [None]
        torch.distributed.broadcast_object_list(sent, src=0)
        key = sent[0]
        if key is None or _sidecar_problem(cache / f"{key}.bin", key)[0]:
            raise TrainerError(f"rank 0 did not leave the token file {cache / f'{key}.bin' if key else 'it was to build'} "
                               f"(its error says why, or {cache} is not a directory this rank sees)\n"
                               f"  fix: a --data-cache on a filesystem all ranks share")
    return TokenFile.open(cache / f"{key}.bin")


def file_digest(path: str | os.PathLike) -> str:
    """The blake2b digest (hex, 32 characters) of a file's bytes, read streaming.

    Example::

        file_digest("examples/data/genesis.txt")   # 'a3f0...': changes when any byte does
    """
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _source_record(file: Path) -> dict:
    """What the sidecar records of a data file: its path, size, mtime and content digest."""
    stat = file.stat()
    return {"path": str(file), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "blake2b": file_digest(file)}


def _cache_key(files: list[Path], tokenizer, text_field: str, digests: Sequence[str]) -> str:
    """The cache entry's name: the files' paths and content digests, the tokenizer and the text field."""
    h = hashlib.sha256(f"fxshard tokens v{CACHE_FORMAT}\n{text_field}\n".encode())
    for file, digest in zip(files, digests, strict=True):
        h.update(f"{file}\n{digest}\n".encode())
    h.update(_tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()[:24]


def _token_digest(bin_path: Path, dtype: str) -> str:
    """The content digest of a token file, as :func:`_build` computes it while writing."""
    h = hashlib.sha256(np.dtype(dtype).str.encode())
    with open(bin_path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()[:16]


def _reusable(bin_path: Path, key: str) -> bool:
    """A finished entry for ``key`` that checks out: the sidecar (renamed into place last, so it
    exists only for a completed build) and the file's length, then the tokens' own digest (a
    changed byte in the token file is a rebuild, not a silently different run)."""
    problem, meta = _sidecar_problem(bin_path, key)
    return problem is None and _token_digest(bin_path, meta["dtype"]) == meta["digest"]


def _build(files, tokenizer, eos, text_field, cache: Path, bin_path: Path, key: str, sources: list[dict]) -> None:
    """Tokenize every document into a temporary file, then rename it (and its sidecar) into place."""
    import datasets

    dtype = np.dtype(np.uint16 if max(tokenizer.get_vocab().values()) < 2 ** 16 else np.uint32)
    content = hashlib.sha256(dtype.str.encode())
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))  # the half-built file and datasets' Arrow copies
    num_tokens = 0
    try:
        with open(tmp / "tokens.bin", "wb") as out, _quiet_datasets():
            for file in files:
                if EXTENSIONS[file.suffix] == "text":
                    ds = datasets.load_dataset("text", data_files=[str(file)], split="train",
                                               cache_dir=str(tmp / "arrow"), keep_linebreaks=True)
                    batches = _text_file_tokens(ds, tokenizer, eos)
                else:
                    batches = _record_tokens(file, text_field, tokenizer, eos)
                for sequences in batches:
                    if not sequences:  # a batch of empty records
                        continue
                    block = np.concatenate([np.asarray(ids, dtype=dtype) for ids in sequences])
                    out.write(block.tobytes())
                    content.update(block.tobytes())
                    num_tokens += block.size
        os.replace(tmp / "tokens.bin", bin_path)
        meta = dict(dtype=dtype.name, num_tokens=num_tokens, digest=content.hexdigest()[:16], key=key,
                    text_field=text_field, files=sources)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(tmp / "meta.json", bin_path.with_suffix(".json"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _quiet_datasets():
    """datasets offline and without progress bars while the trainer reads its local files.

    ``load_dataset`` of a packaged builder ("text", "json") still sends the Hub a download
    count (a request that waits up to 3 s where the Hub is unreachable) unless it is offline.
    """
    import datasets
    saved = {name: getattr(datasets.config, name) for name in ("HF_HUB_OFFLINE", "HF_UPDATE_DOWNLOAD_COUNTS")}
    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.config.HF_HUB_OFFLINE, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = True, False
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(datasets.config, name, value)
        if not bars_were_off:
            datasets.enable_progress_bars()


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids, no special tokens added; one batch call."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]


RECORD_BATCH = 1024  # records encoded per tokenizer call


def _records(file: Path, text_field: str) -> Iterator[tuple[str, Any]]:
    """``(where, text)`` of each record of a .jsonl / .json / .parquet file: only the text
    field is read, so records may carry any other fields (and differ in them).

    ``.jsonl`` (and a ``.json`` that is not an array) a line at a time; a ``.json`` array
    whole; parquet a batch of the one column at a time."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(file)
        names = pf.schema_arrow.names
        if text_field not in names:
            raise TrainerError(f"{file}: the records have no field {text_field!r} (their fields: {', '.join(names)})\n"
                               f"  fix: --text-field with the field that holds the text")
        row = 0
        for batch in pf.iter_batches(batch_size=RECORD_BATCH, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                row += 1
                yield f"{file} row {row}", text
        return
    try:
        with open(file, encoding="utf-8") as f:
            head = f.read(4096).lstrip()
            f.seek(0)
            if file.suffix == ".json" and head.startswith("["):
                try:
                    records = json.load(f)
                except ValueError as e:
                    raise TrainerError(f"{file}: not JSON ({e})\n  fix: an array of records, or one record a line") from None
                for i, record in enumerate(records):
                    yield f"{file} record {i + 1}", _field(record, text_field, f"{file} record {i + 1}")
                return
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise TrainerError(f"{file} line {number}: not JSON ({e})\n  fix: one JSON record a line") from None
                yield f"{file} line {number}", _field(record, text_field, f"{file} line {number}")
    except UnicodeDecodeError as e:
        raise TrainerError(f"{file}: not UTF-8 text ({e})\n  fix: save it as UTF-8") from None


def _field(record, text_field: str, where: str):
    if not isinstance(record, dict):
        raise TrainerError(f"{where}: a {type(record).__name__}, not a record (a JSON object)\n"
                           f"  fix: one JSON object a record, its text in --text-field")
    if text_field not in record:
        raise TrainerError(f"{where}: the record has no field {text_field!r} (its fields: {', '.join(record)})\n"
                           f"  fix: --text-field with the field that holds the text")
    return record[text_field]


def _record_tokens(file: Path, text_field: str, tokenizer, eos: int) -> Iterator[list[list[int]]]:
    """The ids of a json/parquet file's records, a batch of id lists at a time: each record's
    text field, then EOS (an empty text is no document)."""
    texts: list[str] = []
    for where, text in _records(file, text_field):
        if not isinstance(text, str):
            raise TrainerError(f"{where}: the record's {text_field!r} is {type(text).__name__}, not text\n"
                               f"  fix: --text-field with a text field")
        if text:
            texts.append(text)
        if len(texts) == RECORD_BATCH:
            yield [ids for doc in _encode(tokenizer, texts) for ids in (doc, [eos])]
            texts = []
    yield [ids for doc in _encode(tokenizer, texts) for ids in (doc, [eos])]


def _text_file_tokens(ds, tokenizer, eos: int) -> Iterator[list[list[int]]]:
    """The ids of the one document of a .txt file, then EOS, streamed from its lines (a batch
    of id lists at a time).

    The text is encoded in pieces, several per batch call. A piece ends after a line that
    ends in a non-space character where the next line starts with one: with GPT-2-style
    pre-tokenizers the newline is then a token of its own whether the text is cut there or
    not, so the pieces tokenize as the whole file would. Tokenizers without such a split
    (SentencePiece) may tokenize a joint differently, which training does not mind.
    """
    pieces: list[str] = []  # encoded together, BATCH_CHARS at a time
    lines: list[str] = []   # of the piece being gathered
    chars = pending = 0
    for batch in ds.iter(batch_size=4096):
        for line in batch["text"]:
            # a cut where it changes no token, or anywhere when no clean joint came for a long while
            if chars >= PIECE_CHARS and (_safe_cut(lines[-1], line) or chars >= 16 * PIECE_CHARS):
                pieces.append("".join(lines))
                pending += chars
                lines, chars = [], 0
                if pending >= BATCH_CHARS:
                    yield _encode(tokenizer, pieces)
                    pieces, pending = [], 0
            lines.append(line)
            chars += len(line)
    if lines:  # empty only for an empty file, which is no document (no lone EOS)
        pieces.append("".join(lines))
        yield _encode(tokenizer, pieces) + [[eos]]


def _safe_cut(before: str, after: str) -> bool:
    return len(before) >= 2 and before[-1] == "\n" and not before[-2].isspace() and after[:1].strip() != ""


# ----------------------------------------------------------------------------- windows

class PackedTokens:
    """A token file cut into windows of ``seq_len + 1`` tokens that overlap by one.

    Window ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + 1)``: its first ``seq_len``
    are the input ids and its last ``seq_len`` the labels (pre-shifted). The file stays a
    read-only memmap: a window is read when asked for.

    Example::

        tokens = PackedTokens.from_files("examples/data/genesis.txt", tok, seq_len=128, cache_dir="/tmp/tok")
        len(tokens)                     # windows: (num_tokens - 1) // 128
        input_ids, labels = tokens.batch([0, 5])   # [2, 128] int64 each
    """

    def __init__(self, token_file: TokenFile | str | os.PathLike, seq_len: int):
        self.token_file = token_file if isinstance(token_file, TokenFile) else TokenFile.open(token_file)
        self.seq_len = int(seq_len)
        self.num_tokens = self.token_file.num_tokens
        tf = self.token_file
        if tf.dtype not in TOKEN_DTYPES or tf.path.stat().st_size != tf.num_tokens * np.dtype(tf.dtype).itemsize:
            raise TrainerError(f"token file {tf.path}: {tf.num_tokens} tokens of {tf.dtype!r} do not match the file "
                               f"({tf.path.stat().st_size} bytes; a token file holds {', '.join(TOKEN_DTYPES)})\n"
                               f"  fix: TokenFile.open(path) or tokenize_files, which check the file")
        if self.seq_len < 1 or self.num_tokens < self.seq_len + 1:
            raise TrainerError(f"the data has {self.num_tokens} tokens, fewer than one window of "
                               f"seq_len {self.seq_len} + 1\n  fix: more text, or a shorter --seq-len")
        self.tokens = np.memmap(self.token_file.path, dtype=self.token_file.dtype, mode="r",
                                shape=(self.num_tokens,))
        self._windows = (self.num_tokens - 1) // self.seq_len
        # what a resumed loader must find again: these tokens cut at this length
        self.digest = f"{self.token_file.digest}-seq{self.seq_len}"

    @classmethod
    def from_files(cls, files, tokenizer, seq_len: int, *, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
                   text_field: str = "text") -> "PackedTokens":
        """The windows of ``files``' tokens (:func:`tokenize_files` builds or reuses the token file)."""
        return cls(tokenize_files(files, tokenizer, cache_dir=cache_dir, text_field=text_field), seq_len)

    def __len__(self) -> int:
        return self._windows

    def window(self, i: int) -> np.ndarray:
        """Window ``i``: ``seq_len + 1`` token ids."""
        if not 0 <= i < self._windows:
            raise IndexError(f"window {i} of {self._windows}")
        return np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1])

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, int64 ``[len(indices), seq_len]``: the windows' first and last ``seq_len``."""
        rows = np.stack([self.window(int(i)) for i in indices]).astype(np.int64) if len(indices) else \
            np.zeros((0, self.seq_len + 1), dtype=np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


# ----------------------------------------------------------------------------- rows of a step

class TextBatches:
    """Each step's global batch of ``global_batch`` windows, and this dp rank's share of it.

    Global row ``g`` is window ``perm_e[g % n]``, ``e = g // n`` the epoch, ``perm_e`` a
    ``torch.randperm`` seeded by ``(seed, e)``: a new order each epoch, the same in every
    run with this seed (``shuffle=False``: window ``g % n``). Step k reads rows
    ``[k*B, (k+1)*B)``; dp rank r the contiguous ``B/dp`` rows ``r*B/dp ...`` of them.

    Example::

        batches = TextBatches(tokens, global_batch=8, seed=0, dp_rank=1, dp_size=2)
        input_ids, labels = batches.next_batch()   # [4, seq_len]: rows 4..7 of step 0
        sd = batches.state_dict()                  # {"position": 8, "digest": "..."}
    """

    def __init__(self, tokens: PackedTokens, global_batch: int, *, seed: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, shuffle: bool = True):
        if global_batch < 1 or dp_size < 1 or global_batch % dp_size:
            raise TrainerError(f"a global batch of {global_batch} rows does not split over {dp_size} "
                               f"data-parallel ranks\n  fix: a global batch that is a multiple of {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise TrainerError(f"dp rank {dp_rank} is outside 0..{dp_size - 1}")
        self.tokens, self.global_batch, self.seed = tokens, global_batch, seed
        self.dp_rank, self.dp_size, self.shuffle = dp_rank, dp_size, shuffle
        self.local_batch = global_batch // dp_size
        self.position = 0  # global rows consumed, by every rank together
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def epoch(self) -> float:
        """Passes over the data so far (rows consumed / windows), for logging."""
        return self.position / len(self.tokens)

    def window_of_row(self, row: int) -> int:
        """The window that global row ``row`` reads."""
        n = len(self.tokens)
        epoch, i = divmod(row, n)
        if not self.shuffle:
            return i
        if epoch not in self._perms:
            if len(self._perms) > 2:  # a batch spans two epochs at most
                self._perms.pop(min(self._perms))
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._perms[epoch] = torch.randperm(n, generator=generator)
        return int(self._perms[epoch][i])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(input_ids, labels)`` of the next step, int64 ``[global_batch / dp_size, seq_len]``."""
        first = self.position + self.dp_rank * self.local_batch
        windows = [self.window_of_row(g) for g in range(first, first + self.local_batch)]
        self.position += self.global_batch
        return self.tokens.batch(windows)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, in plain Python types (``torch.load(weights_only=True)`` reads it)."""
        return {"position": int(self.position), "digest": str(self.tokens.digest)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken; a TrainerError if it was taken on other data."""
        if state["digest"] != self.tokens.digest:
            raise TrainerError(f"the checkpoint's data position was taken on other data (digest "
                               f"{state['digest']}, this data and seq_len: {self.tokens.digest})\n"
                               f"  fix: resume with the same data files, tokenizer and --seq-len, "
                               f"or start the run afresh")
        self.position = int(state["position"])


def _epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch's order: distinct per (seed, epoch), the same in every process."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


def eval_batches(tokens: PackedTokens, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                 max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``max_batches`` global batches of ``tokens`` in order (all full ones when
    None; a last partial batch is left out), each rank its rows.

    Example::

        for input_ids, labels in eval_batches(eval_tokens, 8, dp_rank=r, dp_size=2, max_batches=4):
            loss += ...
    """
    full = len(tokens) // global_batch
    if full == 0:
        raise TrainerError(f"the eval data has {len(tokens)} windows of seq_len {tokens.seq_len}, fewer than "
                           f"one global batch of {global_batch}\n  fix: more eval text, or a smaller batch")
    batches = TextBatches(tokens, global_batch, dp_rank=dp_rank, dp_size=dp_size, shuffle=False)
    for _ in range(full if max_batches is None else min(max_batches, full)):
        yield batches.next_batch()
