"""accelplane.models.tokenizer against llama.cpp, and text generation.

The oracle is llama.cpp's ``llama_tokenize`` / ``llama_detokenize``: tools/tokenizer_refs.py
wrote its ids for the test texts (English, German, Chinese, Japanese, Russian, Arabic, emoji,
digit and whitespace runs, special tokens) into tests/data/tokenizer/refs.json, on trimmed
copies of real vocabularies (SentencePiece, byte-level BPE of each pre-tokenizer family,
WordPiece) kept beside it. With ``--llama-vocabs DIR`` (llama.cpp's models/ directory) the
whole vocabularies are checked against llama.cpp's ids too. Properties (decode undoes encode,
streaming equals decoding) by hypothesis; the sampler against float64 probabilities; `run
--prompt` end to end on a synthetic model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from accelplane.errors import ConfigError, GGUFError, OutOfRangeError, TokenizerError
from accelplane.models.decoder import DecoderConfig
from accelplane.models.gguf import MetaValue, make_model, model_metadata, read_gguf, write_gguf
from accelplane.models.runner import generate_text
from accelplane.models.sampling import Sampler
from accelplane.models.tokenizer import Tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

DATA = Path(__file__).parent / "data" / "tokenizer"
REFS = json.loads((DATA / "refs.json").read_text())
TEXTS = REFS["texts"]
VOCABS = sorted(REFS["vocabs"])


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_gguf(DATA / f"{name}.gguf") for name in VOCABS}


def _mismatches(tok: Tokenizer, ids: dict[str, list[list[int]]]) -> list[str]:
    bad = []
    for mode, want in ids.items():
        add, parse = bool(int(mode[0])), bool(int(mode[1]))
        for text, w in zip(TEXTS, want, strict=True):
            got = tok.encode(text, add_special=add, parse_special=parse)
            if got != w:
                bad.append(f"{text!r} add_special={add} parse_special={parse}: llama.cpp {w[:10]}..., "
                           f"got {got[:10]}...")  # fmt: skip
    return bad


@pytest.mark.parametrize("name", VOCABS)
def test_encode_matches_llama_cpp(toks, name):
    """Every text, with and without the model's special tokens and special-token parsing."""
    bad = _mismatches(toks[name], REFS["vocabs"][name]["ids"])
    assert not bad, f"{len(bad)} of {len(TEXTS) * len(REFS['modes'])} differ:\n" + "\n".join(bad[:5])


@pytest.mark.parametrize("name", VOCABS)
def test_decode_matches_llama_cpp(toks, name):
    """llama_detokenize(remove_special=False, unparse_special=special) of each text's ids, with
    and without BOS (whose absence lets the first piece lose its leading space)."""
    ref, tok = REFS["vocabs"][name], toks[name]
    assert sorted(ref["decode"]) == ["010", "011", "110", "111"]
    for key, wants in ref["decode"].items():
        mode, special = key[:2], key[2] == "1"
        for text, ids, want in zip(TEXTS, ref["ids"][mode], wants, strict=True):
            assert tok.decode_bytes(ids, special=special) == bytes.fromhex(want), (text, mode, special)


@pytest.mark.parametrize("name", VOCABS)
def test_special_tokens_match_llama_cpp(toks, name):
    ref, tok = REFS["vocabs"][name], toks[name]
    assert (tok.bos, tok.eos, tok.sep) == (ref["bos"], ref["eos"], ref["sep"])
    # with no EOT id in the metadata and several candidates, llama.cpp takes the one its hash map
    # yields first; accelplane the first of llama.cpp's list: either ends generation
    assert tok.eot == ref["eot"] or (tok.eot in ref["eog"] and ref["eot"] in ref["eog"])
    assert (tok.add_bos, tok.add_eos) == (ref["add_bos"], ref["add_eos"])
    assert sorted(tok.eog) == ref["eog"]
    assert all(tok.is_eog(t) for t in ref["eog"])


def test_the_vocabularies_cover_each_kind(toks):
    """The references span SentencePiece, WordPiece and the BPE pre-tokenizer families."""
    kinds = {(t.model, t.pre) for t in toks.values()}
    assert {("llama", None), ("bert", None)} <= kinds
    assert {"llama-bpe", "qwen2", "gpt-2", "default", "starcoder", "falcon"} <= {p for _, p in kinds}


@pytest.mark.parametrize("name", VOCABS)
def test_whole_vocabulary_matches_llama_cpp(name, request):
    """The real vocabulary (llama.cpp's models/ggml-vocab-NAME.gguf, given with --llama-vocabs)."""
    d = request.config.getoption("--llama-vocabs")
    if not d:
        pytest.skip("no --llama-vocabs DIR (llama.cpp's models/ directory) given")
    path = Path(d) / f"ggml-vocab-{name}.gguf"
    full = REFS["vocabs"][name].get("full")
    if full is None:
        pytest.skip(f"{name}: cut from another model's vocabulary (tools/tokenizer_refs.py VOCABS)")
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != full["sha256"]:
        pytest.skip(f"{path}: absent, or not the file the references were made from")
    tok = Tokenizer.from_gguf(path)
    bad = _mismatches(tok, full["ids"])
    assert not bad, "\n".join(bad[:5])
    assert sorted(tok.eog) == full["eog"]


# --- properties ------------------------------------------------------------------------------------
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581"), max_size=60)


@settings(max_examples=150, deadline=None)
@given(text=_TEXT)
def test_decode_undoes_encode(toks, text):
    """Lossless vocabularies give the text back: SentencePiece with byte fallback (one leading
    space is the prefix it adds), byte-level BPE that does not clean spaces."""
    for name in ("phi-3", "qwen2", "deepseek-coder"):
        tok = toks[name]
        assert tok.decode(tok.encode(text, add_special=False)) == text, name


@settings(max_examples=100, deadline=None)
@given(text=_TEXT)
def test_streaming_gives_the_decoded_text(toks, text):
    """Pieces fed one at a time give the same text as decoding them together, whatever byte
    token a character is cut at."""
    tok = toks["qwen2"]
    ids = tok.encode(text, add_special=False)
    s = tok.stream()
    assert "".join(s.feed(t) for t in ids) + s.flush() == tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(text=_TEXT)
def test_wordpiece_words_are_whole_tokens_or_unknown(toks, text):
    """A WordPiece encoding is [CLS] ... [SEP], each id inside a real token."""
    tok = toks["bert-bge"]
    ids = tok.encode(text)
    assert ids[0] == tok.bos and ids[-1] == tok.sep
    assert all(0 <= i < tok.n_vocab for i in ids)


def test_control_tokens_parsed_only_when_asked(toks):
    tok = toks["qwen2"]
    im_start = tok.token_to_id["<|im_start|>"]
    assert tok.encode("<|im_start|>user", add_special=False, parse_special=True)[0] == im_start
    assert im_start not in tok.encode("<|im_start|>user", add_special=False, parse_special=False)
    spm = toks["phi-3"]
    assert spm.encode("<s>x", parse_special=True)[:2] == [spm.bos, spm.bos]
    assert spm.encode("<s>x", parse_special=False).count(spm.bos) == 1


def test_decode_hides_control_tokens_unless_special(toks):
    tok = toks["llama-bpe"]
    ids = tok.encode("Hi", add_special=True)
    assert ids[0] == tok.bos
    assert tok.decode(ids) == "Hi"
    assert tok.decode(ids, special=True) == tok.tokens[tok.bos] + "Hi"


# --- errors ---------------------------------------------------------------------------------------
def _md(**kw) -> dict:
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "\u2581a"]}
    md.update(kw)
    return {k: v for k, v in md.items() if v is not None}


@pytest.mark.parametrize("kw, words", [
    (dict(**{"tokenizer.ggml.model": None}), "no vocabulary (no tokenizer.ggml.model key)"),
    (dict(**{"tokenizer.ggml.tokens": None}), "no vocabulary (tokenizer.ggml.tokens"),
    (dict(**{"tokenizer.ggml.model": "t5"}), "tokenizer.ggml.model 't5' is not supported"),
    (dict(**{"tokenizer.ggml.model": "gpt2"}), "needs tokenizer.ggml.merges"),
    (dict(**{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": [], "tokenizer.ggml.pre": "zzz"}),
     "tokenizer.ggml.pre 'zzz' is not a pre-tokenizer"),
    (dict(**{"tokenizer.ggml.tokens": ["a", 3]}), "entry 1 is a int, not a str"),
    (dict(**{"tokenizer.ggml.scores": [0.0]}), "'tokenizer.ggml.scores' has 1 entries for 4 tokens"),
    (dict(**{"tokenizer.ggml.add_bos_token": 1}), "'tokenizer.ggml.add_bos_token' must be a bool"),
    (dict(**{"tokenizer.ggml.model": 7}), "'tokenizer.ggml.model' must be a string"),
])  # fmt: skip
def test_bad_vocabularies_are_typed_errors(kw, words):
    with pytest.raises(TokenizerError, match=None) as e:
        Tokenizer.from_metadata(_md(**kw))
    assert words in str(e.value)


def test_plain_metadata_may_hold_numpy_values():
    tok = Tokenizer.from_metadata(_md(**{"tokenizer.ggml.scores": np.zeros(4, np.float32),
                                         "tokenizer.ggml.bos_token_id": np.uint32(3)}))  # fmt: skip
    assert tok.bos == 3 and tok.encode("a") == [3, 3]


def test_a_gguf_without_vocabulary_names_the_file(tmp_path):
    p = tmp_path / "m.gguf"
    make_model(p, n_layers=1, d_model=32, n_head=2, d_ff=32, n_vocab=64, wtype="f32", jobs=1)
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf(p)
    assert str(e.value).startswith(f"{p}: the model has no vocabulary")


def test_bad_input_is_a_typed_error(toks):
    tok = toks["phi-3"]
    with pytest.raises(TokenizerError, match="must be a str"):
        tok.encode(b"bytes")
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tok.encode("a\ud800b")
    for bad in (-1, tok.n_vocab, 1.5, True):
        with pytest.raises(OutOfRangeError):
            tok.decode([bad])


def test_a_missing_byte_token_is_named():
    tok = Tokenizer.from_metadata(_md())
    with pytest.raises(TokenizerError, match="no token for byte 0xE2"):  # the ▁ of " b"
        tok.encode("b")


def test_defaults_when_the_metadata_gives_no_ids():
    """llama.cpp's defaults: SentencePiece BOS 1, EOS 2, UNK 0, BOS added; EOS ends generation."""
    tok = Tokenizer.from_metadata(_md())
    assert (tok.bos, tok.eos, tok.unk, tok.add_bos, tok.add_eos) == (1, 2, 0, True, False)
    assert tok.encode("a") == [1, 3] and tok.is_eog(2)


def test_synthetic_models_carry_a_byte_vocabulary():
    """make-model's vocabulary: every text encodes (byte fallback) and decodes back, spaces as
    the ▁ that has no token of its own there."""
    md = model_metadata(DecoderConfig(n_vocab=300, d_model=8, n_layers=1, n_head=1, n_head_kv=1, d_ff=8,
                                      n_ctx_train=64))  # fmt: skip
    tok = Tokenizer.from_metadata(md)
    text = "Grüße, 世界 🦙"
    assert tok.decode(tok.encode(text)) == "\u2581" + text.replace(" ", "\u2581")  # with the space prefix
    assert isinstance(md["tokenizer.ggml.model"], MetaValue)


# --- sampling --------------------------------------------------------------------------------------
def test_greedy_is_the_argmax():
    x = np.array([0.1, 3.0, -1.0, 3.0])
    assert Sampler()(x) == 1  # the lower id on a tie


def test_sampling_follows_top_k_top_p_and_temperature():
    """Frequencies of 20000 draws vs the float64 distribution llama.cpp's chain defines."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    s = Sampler(temp=0.7, top_k=4, top_p=0.9, seed=1)
    # top-k 4: ids 5, 0, 1, 2; their probabilities at temperature 1 reach 0.9 with 5, 0, 1
    keep = np.array([5, 0, 1])
    p = np.exp(logits[keep] / 0.7)
    p /= p.sum()
    draws = np.bincount([s(logits) for _ in range(20000)], minlength=6)
    assert draws[[2, 3, 4]].sum() == 0
    assert np.allclose(draws[keep] / 20000, p, atol=0.015)


def test_sampling_is_seeded():
    x = np.random.default_rng(0).standard_normal(50)
    a = [Sampler(1.0, 0, 1.0, seed=7)(x) for _ in range(1)] + [Sampler(1.0, 0, 1.0, seed=7)(x)]
    assert a[0] == a[1]
    s1, s2 = Sampler(1.0, 10, 0.9, seed=3), Sampler(1.0, 10, 0.9, seed=3)
    assert [s1(x) for _ in range(20)] == [s2(x) for _ in range(20)]


@pytest.mark.parametrize("kw", [dict(temp=float("nan")), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                dict(seed=-1), dict(top_k=2.5)])  # fmt: skip
def test_bad_sampler_settings(kw):
    with pytest.raises(ConfigError):
        Sampler(**kw)


# --- generation ------------------------------------------------------------------------------------
class _Scripted:
    """A model stub whose logits make the given ids the argmax, one per eval."""

    def __init__(self, n_vocab: int, script: list[int]) -> None:
        self.cfg = type("Cfg", (), {"n_vocab": n_vocab})()
        self.script, self.calls = list(script), []

    def reset(self) -> None:
        self.calls.clear()

    def eval(self, tokens, want_logits=True):
        self.calls.append(list(tokens))
        t = self.script[len(self.calls) - 1]
        logits = np.zeros((1, self.cfg.n_vocab), np.float32)
        logits[0, t] = 50.0  # so a sampler picks it too
        return type("R", (), {"ids": np.array([t]), "logits": logits})()

    def decode(self, first, n, on_token=None, stop=None):  # DecoderModel.decode's contract
        out = []
        for _ in range(n):
            out.append(int(self.eval(out[-1:] or [first]).ids[-1]))
            if on_token:
                on_token(out[-1])
            if stop and stop(out[-1]):
                break
        return out


def test_generation_stops_at_end_of_generation(toks):
    tok = toks["qwen2"]
    a, b = tok.encode("Hello", add_special=False)[0], tok.encode(" world", add_special=False)[0]
    m = _Scripted(tok.n_vocab, [a, b, tok.eos, a])
    shown = []
    res = generate_text(m, tok, [a], 10, Sampler(), shown.append)
    assert res.tokens == [a, b] and res.eog == tok.eos and res.steps == 2
    assert "".join(shown) == res.text == tok.decode([a, b])
    assert m.calls == [[a], [a], [b]]  # the prompt, then each picked token


def test_generation_stops_at_the_limit(toks):
    tok = toks["phi-3"]
    t = tok.encode("a", add_special=False)[0]
    res = generate_text(_Scripted(tok.n_vocab, [t] * 5), tok, [tok.bos], 3, Sampler(temp=0.5, seed=1))
    assert res.tokens == [t, t, t] and res.eog is None


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A synthetic model with make-model's byte vocabulary (300 tokens)."""
    p = tmp_path_factory.mktemp("tok") / "m.gguf"
    make_model(p, n_layers=1, d_model=32, n_head=2, d_ff=64, n_vocab=300, wtype="f32", jobs=1)
    return p


def test_run_prompt_end_to_end(small_model, capsys):
    from accelplane import cli

    argv = ["run", "--model", str(small_model), "-d", "CPU", "--prompt", "Grüße aus 東京", "--tokens", "5"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "prompt: " in err and "tokens/s" in err and "generated 5 tokens; stopped at --tokens 5" in err
    assert "model:" not in out and out.endswith("\n")
    assert cli.main(argv + ["--temp", "0.8", "--top-k", "5", "--seed", "2"]) == 0
    first = capsys.readouterr().out
    assert cli.main(argv + ["--temp", "0.8", "--top-k", "5", "--seed", "2"]) == 0
    assert capsys.readouterr().out == first  # seeded


@pytest.mark.parametrize("extra, words", [
    (["--temp", "0.5"], "--temp needs --prompt"),
    (["--prompt", "x", "--top-k", "3"], "--top-k and --top-p need --temp > 0"),
    (["--prompt", "x", "--prompt-tokens", "3"], "cannot go with --prompt"),
    (["--prompt", "x", "--top-p", "0"], "expected a number in (0, 1]"),
    (["--prompt", "x", "--temp", "-1"], "expected a finite number >= 0"),
])  # fmt: skip
def test_run_prompt_usage_errors(extra, words, small_model, capsys):
    from accelplane import cli

    assert cli.main(["run", "--model", str(small_model), *extra]) == 2
    assert words in capsys.readouterr().err


def test_run_prompt_needs_a_vocabulary(tmp_path, capsys):
    from accelplane import cli

    p = tmp_path / "m.gguf"
    make_model(p, n_layers=1, d_model=32, n_head=2, d_ff=32, n_vocab=64, wtype="f32", jobs=1)
    assert cli.main(["run", "--model", str(p), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no vocabulary" in err[0] and "--prompt" in err[0]


# --- reading vocabularies ---------------------------------------------------------------------------
def _vocab_file(tmp_path, tokens):
    import gguf

    V = gguf.GGUFValueType
    p = tmp_path / "v.gguf"
    write_gguf(p, {"general.architecture": MetaValue("llama", V.STRING),
                   "tokenizer.ggml.model": MetaValue("llama", V.STRING),
                   "tokenizer.ggml.tokens": MetaValue(tokens, V.ARRAY, V.STRING)}, [])  # fmt: skip
    return p


def test_string_arrays_read_as_the_gguf_package_reads_them(tmp_path):
    import gguf

    tokens = ["<unk>", "", "\u2581a", "日本", "🦙" * 50, *(f"t{i}" for i in range(300))]
    p = _vocab_file(tmp_path, tokens)
    stock = gguf.GGUFReader(p).fields["tokenizer.ggml.tokens"].contents()
    assert read_gguf(p).metadata["tokenizer.ggml.tokens"].value == stock == tokens


def test_a_cut_or_broken_string_in_a_vocabulary_names_the_key(tmp_path):
    p = _vocab_file(tmp_path, ["aa", "bb", "cc"])
    raw = p.read_bytes()
    at = raw.index((2).to_bytes(8, "little") + b"bb")
    key_at = raw.index(b"tokenizer.ggml.tokens") - 8
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw[:at] + (1 << 40).to_bytes(8, "little") + raw[at + 8 :])
    with pytest.raises(GGUFError, match=f"metadata key 'tokenizer.ggml.tokens' at file offset {key_at}: "
                                        f"truncated: needs file bytes \\[{at + 8}, "):  # fmt: skip
        read_gguf(bad)
    bad.write_bytes(raw[: at + 8] + b"\xff" + raw[at + 9 :])
    with pytest.raises(GGUFError, match="'tokenizer.ggml.tokens' at file offset .*: a string is not UTF-8"):
        read_gguf(bad)
