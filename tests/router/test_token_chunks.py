"""Chunked encoding (router/token_chunks.py): the same ids as a whole encode, for every kind
of tokenizer it accepts; refused where it cannot be exact; reuse, its bound, the audit."""

from __future__ import annotations

import logging
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import (
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
from router.token_chunks import ChunkedEncoder, cut_points
from router.tokenizer import LocalTokenizer

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
    encoder = ChunkedEncoder.create(tokenizer, 1_000_000)
    assert encoder is not None
    for text in _texts(seed=3, count=30):
        for chunk_chars in (1, 64, 1024):
            for specials in (True, False):
                expected = tokenizer.encode(text, add_special_tokens=specials).ids
                assert encoder.encode_chunks(text, specials, chunk_chars) == expected, text


def test_a_tokenizer_that_looks_across_spaces_is_refused(caplog):
    with caplog.at_level(logging.INFO, "router.tokenizer"):
        assert ChunkedEncoder.create(llama2_legacy(), 1_000_000) is None
    assert "this tokenizer looks across spaces" in caplog.text


def test_a_shared_prefix_is_encoded_once(tiny: Path, tiny_tokenizer: Tokenizer):
    local = LocalTokenizer.load(tiny)
    assert local.chunks is not None
    first = CORPUS[:20_000]
    second = first + " and then the next turn of the conversation " + CORPUS[40_000:42_000]
    for text in (first, second):
        assert local.encode(text, True) == tiny_tokenizer.encode(text).ids
    stats = local.chunks.stats
    # all of the second prompt but its last chunks came from the first one's
    assert stats.reused_tokens > 0.8 * len(tiny_tokenizer.encode(first).ids)
    assert stats.encoded_tokens < 1.3 * len(tiny_tokenizer.encode(first).ids)
    assert stats.audits == 1 and stats.disagreements == 0 and local.chunks.active


def test_short_prompts_are_encoded_whole_and_nothing_is_kept(tiny: Path):
    local = LocalTokenizer.load(tiny)
    assert local.chunks is not None
    local.encode(CORPUS[:1000], True)
    assert local.chunks.stats.cached_tokens == 0 and local.chunks.stats.encoded_tokens == 0


def test_the_cache_holds_at_most_its_bound(tiny_tokenizer: Tokenizer):
    encoder = ChunkedEncoder.create(tiny_tokenizer, 5_000)
    assert encoder is not None
    for start in range(0, 200_000, 25_000):
        text = CORPUS[start : start + 20_000]
        assert encoder.encode(text, True) == tiny_tokenizer.encode(text).ids
        assert 0 < encoder.stats.cached_tokens <= 5_000


def test_threads_encoding_at_once_get_their_own_ids(tiny_tokenizer: Tokenizer):
    encoder = ChunkedEncoder.create(tiny_tokenizer, 50_000)
    assert encoder is not None
    texts = [CORPUS[: 4_000 + 997 * i] for i in range(40)]  # shared prefixes, evictions
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda t: encoder.encode(t, False), texts * 3))
    assert results == [tiny_tokenizer.encode(t, add_special_tokens=False).ids for t in texts * 3]


def test_an_audit_that_finds_a_difference_turns_chunking_off(tiny_tokenizer: Tokenizer, caplog):
    # a normalizer rewriting a phrase across a space: the probes never contain it, a prompt does
    tokenizer = Tokenizer.from_str(tiny_tokenizer.to_str())
    tokenizer.normalizer = normalizers.Replace("qq ww", "x")
    encoder = ChunkedEncoder.create(tokenizer, 1_000_000)
    assert encoder is not None and encoder.active
    text = "a" * 1030 + "qq ww " + CORPUS[:3000]  # the first cut: between qq and ww
    whole = tokenizer.encode(text).ids
    assert encoder.encode_chunks(text, True, 1) != whole  # what chunking would have said
    assert encoder.encode(text, True) == whole  # the first chunked encode is audited
    assert not encoder.active and encoder.stats.disagreements == 1
    assert encoder.stats.cached_tokens == 0
    assert "prompts are encoded whole from now on" in caplog.text
    assert encoder.encode(text, True) == whole and encoder.stats.audits == 1
