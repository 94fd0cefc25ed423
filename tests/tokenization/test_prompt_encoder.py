"""The prompt encoder (``tokenization.prompt_encoder``, ``tokenization.fast_bpe``): tiktoken
and chunked encoding give HF's whole ids for every kind of tokenizer they accept, each is refused
where it cannot be exact; reuse, its bound, the audit."""

from __future__ import annotations

import json
import logging
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from fleet.tiny_model import write_tiny_model
from tokenization.fast_bpe import FastBPE
from tokenization.prompt_encoder import AUDIT_EVERY, PromptEncoder, cut_points, probe_texts
from tokenization.tokenizer import InvalidPrompt, LocalTokenizer

CORPUS = (Path(__file__).parents[2] / "fleet" / "tiny_model_corpus.txt").read_text()
# Llama 3's pre-tokenizer pattern (its tokenizer.json's Split)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _trained(tokenizer: Tokenizer, trainer: object) -> Tokenizer:
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    return tokenizer


def llama3_like() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|begin_of_text|>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    _trained(tokenizer, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    return tokenizer


def metaspace_bpe() -> Tokenizer:
    """SentencePiece-style BPE as converted today (Mistral, Llama 2 non-legacy)."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace()
    return _trained(tokenizer, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<s>"]))


def wordpiece() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=2000, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    _trained(tokenizer, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    return tokenizer


def unigram() -> Tokenizer:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=1000, special_tokens=["<unk>"], unk_token="<unk>")
    return _trained(tokenizer, trainer)


def llama2_legacy() -> Tokenizer:
    """Llama 2's legacy tokenizer.json: a normalizer that prepends "▁" to whatever it gets,
    no pre-tokenizer. A chunk after a cut would get a "▁" the whole text has not."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    return _trained(tokenizer, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<s>"]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny / "tokenizer.json"))


def _texts(seed: int, count: int) -> list[str]:
    """Slices of the corpus, some with odd spacing, digits, accents and special tokens."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        start = rng.randrange(len(CORPUS) - 6000)
        text = CORPUS[start : start + rng.randrange(50, 6000)]
        if rng.random() < 0.4:
            odd = rng.choice(["  ", " é ", " 12 ", " <|eot_id|> ", " [SEP] ", "\t", " </s>"])
            text = text.replace(" ", odd, rng.randrange(30))
        texts.append(text)
    return texts


def test_cuts_are_spaces_between_alphanumerics_and_depend_only_on_what_precedes():
    text = "ab cd,  ef gh\nij kl 12 34 é ü"
    cuts = cut_points(text, 1)
    assert cuts[0] == 0 and cuts[-1] == len(text)
    inner = cuts[1:-1]
    assert inner == [2, 10, 16, 19, 22, 25, 27]
    for cut in inner:
        assert text[cut] == " " and text[cut - 1].isalnum() and text[cut + 1].isalnum()
    # a text sharing a prefix has every cut that lies inside the prefix (but its last char)
    longer = text[:18] + " zz yy"
    assert [c for c in cut_points(longer, 1) if c < 17] == [c for c in cuts if c < 17]
    assert cut_points("no-space-at-all", 1) == [0, 15]


@pytest.mark.parametrize("kind", ["tiny", llama3_like, metaspace_bpe, wordpiece, unigram])
def test_chunked_ids_are_the_whole_ids(kind, tiny_tokenizer):
    tokenizer = tiny_tokenizer if kind == "tiny" else kind()
    encoder = PromptEncoder.create(tokenizer, 1_000_000)
    assert encoder is not None
    for text in _texts(seed=3, count=30):
        for chunk_chars in (1, 64, 1024):
            for specials in (True, False):
                expected = tokenizer.encode(text, add_special_tokens=specials).ids
                assert encoder.encode_chunks(text, specials, chunk_chars) == expected, text


def test_a_tokenizer_that_looks_across_spaces_is_refused(caplog):
    with caplog.at_level(logging.INFO, "tokenization"):
        assert PromptEncoder.create(llama2_legacy(), 1_000_000) is None
    assert "this tokenizer looks across spaces" in caplog.text
    assert "prompts are encoded by HF tokenizers: the normalizer is not NFC" in caplog.text


def test_a_shared_prefix_is_encoded_once(tiny: Path, tiny_tokenizer: Tokenizer):
    local = LocalTokenizer.load(tiny)
    assert local.encoder is not None
    first = CORPUS[:20_000]
    second = first + " and then the next turn of the conversation " + CORPUS[40_000:42_000]
    for text in (first, second):
        assert local.encode(text, True) == tiny_tokenizer.encode(text).ids
    stats = local.encoder.stats
    # all of the second prompt but its last chunks came from the first one's
    assert stats.reused_tokens > 0.8 * len(tiny_tokenizer.encode(first).ids)
    assert stats.encoded_tokens < 1.3 * len(tiny_tokenizer.encode(first).ids)
    local.encoder.settle()
    assert stats.audits == 1 and stats.disagreements == 0 and local.encoder.active


def test_short_prompts_are_encoded_whole_and_nothing_is_kept(tiny: Path):
    local = LocalTokenizer.load(tiny)
    assert local.encoder is not None
    local.encode(CORPUS[:1000], True)
    assert local.encoder.stats.cached_tokens == 0 and local.encoder.stats.encoded_tokens == 0


def test_the_cache_holds_at_most_its_bound(tiny_tokenizer: Tokenizer):
    encoder = PromptEncoder.create(tiny_tokenizer, 5_000)
    assert encoder is not None
    for start in range(0, 200_000, 25_000):
        text = CORPUS[start : start + 20_000]
        assert encoder.encode(text, True) == tiny_tokenizer.encode(text).ids
        assert 0 < encoder.stats.cached_tokens <= 5_000


def test_threads_encoding_at_once_get_their_own_ids(tiny_tokenizer: Tokenizer):
    encoder = PromptEncoder.create(tiny_tokenizer, 50_000)
    assert encoder is not None
    texts = [CORPUS[: 4_000 + 997 * i] for i in range(40)]  # shared prefixes, evictions
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda t: encoder.encode(t, False), texts * 3))
    assert results == [tiny_tokenizer.encode(t, add_special_tokens=False).ids for t in texts * 3]


def test_an_audit_that_finds_a_difference_turns_chunking_off(tiny_tokenizer: Tokenizer, caplog):
    # a normalizer rewriting a phrase across a space: the probes never contain it, a prompt does
    tokenizer = Tokenizer.from_str(tiny_tokenizer.to_str())
    tokenizer.normalizer = normalizers.Replace("qq ww", "x")
    encoder = PromptEncoder.create(tokenizer, 1_000_000)
    assert encoder is not None and encoder.active
    assert encoder.fast is None  # tiktoken does not take a Replace normalizer
    text = "a" * 1030 + "qq ww " + CORPUS[:3000]  # the first cut: between qq and ww
    whole = tokenizer.encode(text).ids
    chunked = encoder.encode_chunks(text, True, 1)
    assert chunked != whole  # what chunking says
    assert encoder.encode(text, True) == chunked  # the first encode is audited, off its path
    encoder.settle()
    assert not encoder.active and encoder.stats.disagreements == 1
    assert encoder.stats.cached_tokens == 0
    assert "prompts are encoded whole by HF from now on" in caplog.text
    assert encoder.encode(text, True) == whole and encoder.stats.audits == 1


def qwen2_like() -> Tokenizer:
    """Qwen 2's shape: NFC, then Llama 3's kind of Split before a ByteLevel without regex."""
    tokenizer = llama3_like()
    tokenizer.normalizer = normalizers.NFC()
    return tokenizer


def _merges_out_of_order(tiny_tokenizer: Tokenizer) -> Tokenizer:
    spec = json.loads(tiny_tokenizer.to_str())
    merges = spec["model"]["merges"]
    merges[10], merges[20] = merges[20], merges[10]
    return Tokenizer.from_str(json.dumps(spec))


def _added_token_that_strips(tiny_tokenizer: Tokenizer) -> Tokenizer:
    tokenizer = Tokenizer.from_str(tiny_tokenizer.to_str())
    tokenizer.add_special_tokens([AddedToken("<|strip|>", lstrip=True)])
    return tokenizer


def _merges_a_pair_tiktoken_would_not() -> Tokenizer:
    """A pair "bc" merging before "ab": HF never sees ("ab", "c") in "abc" and gives ["a", "bc"];
    tiktoken, merging whatever the vocabulary holds, gives ["abc"]."""
    vocab = {char: n for n, char in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab |= {"bc": 256, "ab": 257, "abc": 258}
    tokenizer = Tokenizer(models.BPE(vocab, [("b", "c"), ("a", "b"), ("ab", "c")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


FROM_TINY = (_merges_out_of_order, _added_token_that_strips)


def _fast(tokenizer: Tokenizer) -> FastBPE | None:
    return FastBPE.create(tokenizer, probe_texts(tokenizer))


@pytest.mark.parametrize("kind", ["tiny", llama3_like, qwen2_like])
def test_tiktoken_gives_hf_ids(kind, tiny_tokenizer):
    tokenizer = tiny_tokenizer if kind == "tiny" else kind()
    fast = _fast(tokenizer)
    assert fast is not None
    # NFC composes "e" and U+0301, also after an added token; ">" with U+0338 is "≯"
    odd = ["", "cafe\u0301 au lait", "<|eot_id|>\u0301x", "<|eot_id|>\u0338 a", "<|eot_id|>" * 3]
    for text in _texts(seed=5, count=40) + odd:
        assert fast.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, text
    encoder = PromptEncoder.create(tokenizer, 0)
    assert encoder is not None and encoder.fast is not None and not encoder.chunking
    for text in _texts(seed=6, count=10):
        assert encoder.encode(text, True) == tokenizer.encode(text).ids


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (metaspace_bpe, "the pre-tokenizer is not a byte-level regex split"),
        (wordpiece, "the model is WordPiece, not BPE"),
        (unigram, "the model is Unigram, not BPE"),
        (llama2_legacy, "the normalizer is not NFC: Sequence"),
        (_merges_out_of_order, "the merges are not in the order of their results' ids"),
        (_added_token_that_strips, "added token '<|strip|>' strips or is a word"),
        (_merges_a_pair_tiktoken_would_not, "tiktoken differs on 'abc'"),
    ],
)
def test_tiktoken_is_refused_where_it_cannot_be_exact(make, reason, tiny_tokenizer, caplog):
    tokenizer = make(tiny_tokenizer) if make in FROM_TINY else make()
    with caplog.at_level(logging.INFO, "tokenization"):
        assert _fast(tokenizer) is None
    assert f"prompts are encoded by HF tokenizers: {reason}" in caplog.text


@pytest.mark.parametrize("chunk_cache_tokens", [0, 1_000_000])
def test_a_lone_surrogate_is_refused_as_hf_refuses_it(tiny: Path, chunk_cache_tokens: int):
    local = LocalTokenizer.load(tiny, chunk_cache_tokens)
    assert local.encoder is not None and local.encoder.fast is not None
    long = "a " * 2000  # chunked when chunks are kept
    for text in ("a\ud800b", long + "\udfff"):
        with pytest.raises(InvalidPrompt, match="a lone surrogate at"):
            local.encode(text, True)


def test_an_audit_that_finds_tiktoken_wrong_turns_it_off(tiny_tokenizer: Tokenizer, caplog):
    encoder = PromptEncoder.create(tiny_tokenizer, 1_000_000)
    assert encoder is not None and encoder.fast is not None
    encoder.fast = _fast(llama3_like())  # another vocabulary's ids: wrong for this one
    text = CORPUS[:500]
    wrong = encoder.encode(text, False)
    encoder.settle()
    right = tiny_tokenizer.encode(text, add_special_tokens=False).ids
    assert wrong != right and not encoder.active and encoder.stats.disagreements == 1
    assert encoder.encode(text, False) == right
    assert "prompts are encoded whole by HF from now on" in caplog.text


def test_one_encode_in_audit_every_is_audited(tiny_tokenizer: Tokenizer):
    encoder = PromptEncoder.create(tiny_tokenizer, 1_000_000)
    assert encoder is not None
    for n in range(2 * AUDIT_EVERY + 1):
        encoder.encode(CORPUS[n : n + 300], True)
        encoder.settle()
    assert encoder.stats.audits == 3 and encoder.stats.disagreements == 0


def test_a_caller_changing_its_ids_does_not_fail_the_audit(tiny_tokenizer: Tokenizer):
    encoder = PromptEncoder.create(tiny_tokenizer, 1_000_000)
    assert encoder is not None
    ids = encoder.encode(CORPUS[:5000], False)  # audited: the first encode
    ids.append(7)  # as an engine appends what it generates
    encoder.settle()
    assert encoder.stats.audits == 1 and encoder.stats.disagreements == 0 and encoder.active
