"""Text to token ids and back, from a GGUF model's own vocabulary, token for token as
llama.cpp's ``llama_tokenize`` and ``llama_detokenize`` do it.

The vocabulary is the ``tokenizer.ggml.*`` metadata. ``tokenizer.ggml.model`` picks the
algorithm:

- ``llama``: SentencePiece BPE over the pieces' scores (``tokenizer.ggml.scores``): the text's
  spaces become ``▁`` (and one is put in front of the text, ``tokenizer.ggml.add_space_prefix``,
  default on), then the adjacent pair whose joined text is the best-scoring token is merged
  until none is left; a character no token covers falls back to its UTF-8 bytes (``<0xXX>``).
- ``gpt2``: byte-level BPE. A pre-tokenizer chosen by ``tokenizer.ggml.pre`` splits the text
  with its regular expressions (``\\p{L}``-style classes, through the ``regex`` package), each
  piece's UTF-8 bytes are mapped to GPT-2's printable characters, then the pairs are merged by
  the rank of ``tokenizer.ggml.merges``. :data:`PRE_TOKENIZERS` lists the names understood.
- ``bert``: WordPiece, as llama.cpp converts it (word starts carry ``▁``, continuations are bare):
  the text is lowercased and stripped of accents (``tokenizer.ggml.normalizer.*``), split at
  whitespace, punctuation and CJK ideographs, then each word is cut greedily into the longest
  tokens; a word that cannot be cut is one unknown token.

Special tokens: BOS/EOS/EOT/EOM/UNK/SEP/PAD/MASK ids from ``tokenizer.ggml.*_token_id`` (else
llama.cpp's defaults of the model type), ``add_bos``/``add_eos`` from
``tokenizer.ggml.add_bos_token`` / ``add_eos_token``; the end-of-generation set (:meth:`Tokenizer.is_eog`)
is EOS, EOT, EOM and the tokens llama.cpp recognizes by their text (``<|eot_id|>``, ``<|im_end|>``,
``<|endoftext|>``, ...). Control tokens written in the text (``<|im_start|>``) become their ids
only with ``parse_special=True``; user-defined tokens always do.

Character classes (letters, numbers, whitespace, ...) are the ``regex`` package's Unicode tables;
llama.cpp's may be of a newer Unicode version, so a character assigned only in that version may
split differently. Everything else is llama.cpp's algorithm, including its quirks.
"""

from __future__ import annotations

import codecs
import heapq
import operator
import os
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntFlag
from functools import cache, lru_cache
from typing import Any

import numpy as np

from accelplane.errors import OutOfRangeError, TokenizerError


class Attr(IntFlag):
    """llama.cpp's token attributes (``llama_token_attr``)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# tokenizer.ggml.token_type values (llama_token_type) -> attributes; other values are UNDEFINED
_TYPE_ATTR = {1: Attr.NORMAL, 2: Attr.UNKNOWN, 3: Attr.CONTROL, 4: Attr.USER_DEFINED, 5: Attr.UNUSED,
              6: Attr.BYTE}  # fmt: skip
_SPECIAL = Attr.CONTROL | Attr.UNKNOWN  # hidden by decode unless special=True
_SPACE = "\u2581"  # SentencePiece's escaped space "▁"
_ISSPACE = " \t\n\v\f\r"  # C isspace(), which llama.cpp strips around LSTRIP/RSTRIP tokens

# --- pre-tokenizers (tokenizer.ggml.pre) --------------------------------------------------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")  # fmt: skip
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# the Latin, Greek, Cyrillic, ... letters of deepseek-llm's tokenizer.json, as llama.cpp has them
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134"
    "\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)  # fmt: skip


@dataclass(frozen=True)
class PreTokenizer:
    """A pre-tokenizer: its regular expressions, applied one after the other (each splits every
    piece the previous ones left into its matches and the text between them), and the
    llama.cpp settings that come with it."""

    patterns: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is taken as it is
    clean_spaces: bool = True  # decode drops the space before . , ! ? and some contractions
    add_bos: bool = False  # the default when tokenizer.ggml.add_bos_token is absent
    add_sep: bool = False


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GROUPS: list[tuple[tuple[str, ...], PreTokenizer]] = [
    (("default",), _DEFAULT),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), PreTokenizer((_QWEN2,), clean_spaces=False)),
    (("stablelm2",), PreTokenizer((_QWEN2,))),
    (("qwen35",), PreTokenizer((_QWEN35,), clean_spaces=False)),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "mpt", "olmo"), PreTokenizer((_GPT2,))),
    (("jina-v1-en", "jina-v2-code", "roberta-bpe"), PreTokenizer((_GPT2,), add_sep=True)),
    (("starcoder", "refact", "smollm", "codeshell", "exaone", "minerva", "mellum2"),
     PreTokenizer((r"\p{N}", _GPT2))),
    (("command-r",), PreTokenizer((r"\p{N}", _GPT2), clean_spaces=False)),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"))),
    (("deepseek-llm",), PreTokenizer(("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+",
                                      "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                                      r"\s+\Z", _CJK, r"\p{N}+"), clean_spaces=False)),
    (("deepseek-coder",), PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
                                       clean_spaces=False)),
]  # fmt: skip
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _GROUPS for name in names}


@cache
def _compiled(pattern: str):
    try:
        import regex
    except ImportError as e:  # pragma: no cover - regex is a dependency
        raise TokenizerError("BPE pre-tokenizers need the 'regex' package: pip install regex") from e
    return regex.compile(pattern)


def split_pieces(text: str, patterns: Iterable[str]) -> list[str]:
    """``text`` cut by each pattern in turn as llama.cpp's ``unicode_regex_split`` does: every
    match, and every stretch between matches, of every piece so far becomes a piece."""
    pieces = [text] if text else []
    for pat in patterns:
        rx, out = _compiled(pat), []
        for p in pieces:
            pos = 0
            for m in rx.finditer(p):
                if m.start() > pos:
                    out.append(p[pos : m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(p):
                out.append(p[pos:])
        pieces = out
    return pieces


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (llama.cpp's unicode_byte_to_utf8)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
_BYTE_ENCODE = [BYTE_TO_UNICODE[b] for b in range(256)]


def byte_encode(s: str) -> str:
    """``s``'s UTF-8 bytes as GPT-2's characters (the text byte-level BPE tokens are made of)."""
    return "".join([_BYTE_ENCODE[b] for b in s.encode("utf-8")])


# --- special tokens llama.cpp finds by their text ------------------------------------------------
# slot -> texts, in order (the first present is taken when the metadata gives no id)
_DETECT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
            "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))  # fmt: skip
# (metadata key, slot) of the ids llama.cpp reads; later keys of a slot are deprecated spellings
_ID_KEYS = (("bos", "bos"), ("eos", "eos"), ("eot", "eot"), ("eom", "eom"), ("unknown", "unk"),
            ("seperator", "sep"), ("padding", "pad"), ("mask", "mask"), ("fim_pre", "fim_pre"),
            ("fim_suf", "fim_suf"), ("fim_mid", "fim_mid"), ("fim_pad", "fim_pad"), ("fim_rep", "fim_rep"),
            ("fim_sep", "fim_sep"), ("prefix", "fim_pre"), ("suffix", "fim_suf"),
            ("middle", "fim_mid"))  # fmt: skip
# each model type's default ids (llama_vocab::impl::load)
_DEFAULT_IDS = {"llama": dict(bos=1, eos=2, unk=0), "gpt2": dict(bos=11, eos=11),
                "bert": dict(bos=101, unk=100, sep=102, pad=0, mask=103)}  # fmt: skip
# always user-defined (llama.cpp's rule for gpt-oss)
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def _meta(md: Mapping[str, Any], key: str, kind: type, default: Any = None, where: str = "") -> Any:
    """Metadata value ``key`` (a MetaValue's value, or a plain value) checked to be ``kind``."""
    v = md.get(key)
    if v is None:
        return default
    v = getattr(v, "value", v)
    if isinstance(v, np.generic | np.ndarray):  # plain metadata may hold numpy values
        v = v.tolist()
    ok = (isinstance(v, bool) if kind is bool else isinstance(v, str) if kind is str
          else isinstance(v, int) and not isinstance(v, bool) if kind is int
          else isinstance(v, list | tuple))  # fmt: skip
    if not ok:
        want = {bool: "a bool", str: "a string", int: "an integer"}.get(kind, "an array")
        raise TokenizerError(f"{where}metadata key {key!r} must be {want}, got {type(v).__name__}")
    return v


def _array(md: Mapping[str, Any], key: str, n: int, item: tuple[type, ...], where: str) -> list | None:
    v = _meta(md, key, list, None, where)
    if v is None:
        return None
    if len(v) < n:
        raise TokenizerError(f"{where}metadata key {key!r} has {len(v)} entries for {n} tokens")
    bad = next((i for i, x in enumerate(v) if not isinstance(x, item) or isinstance(x, bool)), None)
    if bad is not None:
        raise TokenizerError(f"{where}metadata key {key!r}: entry {bad} is a {type(v[bad]).__name__}, "
                             f"not a {' or '.join(t.__name__ for t in item)}")  # fmt: skip
    return list(v)


class Tokenizer:
    """A GGUF model's tokenizer (see the module docstring). Build it with :meth:`from_gguf` or
    :meth:`from_metadata`; :meth:`encode` and :meth:`decode` are llama.cpp's ``llama_tokenize``
    and ``llama_detokenize``. Attributes: ``model`` (``llama``, ``gpt2``, ``bert``), ``pre`` (the
    pre-tokenizer name, BPE only), ``tokens`` (each id's text), ``bos``, ``eos``, ``eot``,
    ``eom``, ``unk``, ``sep``, ``pad``, ``mask`` (ids or None), ``add_bos``, ``add_eos``,
    ``add_sep``, ``eog`` (the end-of-generation ids)."""

    def __init__(self, md: Mapping[str, Any], where: str = "") -> None:
        self._where = where
        model = _meta(md, "tokenizer.ggml.model", str, None, where)
        if model is None:
            raise TokenizerError(f"{where}the model has no vocabulary (no tokenizer.ggml.model key), so it "
                                 "cannot tokenize text")  # fmt: skip
        if model not in _DEFAULT_IDS:
            raise TokenizerError(f"{where}tokenizer.ggml.model {model!r} is not supported (accelplane "
                                 f"tokenizes {', '.join(sorted(_DEFAULT_IDS))})")  # fmt: skip
        tokens = _array(md, "tokenizer.ggml.tokens", 0, (str,), where)
        if not tokens:
            raise TokenizerError(f"{where}the model has no vocabulary (tokenizer.ggml.tokens is missing "
                                 "or empty)")  # fmt: skip
        n = len(tokens)
        self.model, self.n_vocab = model, n
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.token_to_id = {t: i for i, t in enumerate(self.tokens)}  # a repeated text: the last id
        scores = _array(md, "tokenizer.ggml.scores", n, (int, float), where) or [0.0] * n
        self.scores = [float(s) for s in scores[:n]]
        types = _array(md, "tokenizer.ggml.token_type", n, (int,), where)
        types = [1] * n if types is None else types[:n]
        self.attrs = [_TYPE_ATTR.get(t, Attr.UNDEFINED) for t in types]
        self.max_token_len = max(len(t.encode()) for t in self.tokens)
        self._setup_model(md, model, where)
        self._setup_special(md, model, where)

    @classmethod
    def from_gguf(cls, file: Any) -> Tokenizer:
        """The tokenizer of a GGUF file: a path or a :class:`~accelplane.models.gguf.GGUFFile`.
        TokenizerError (one line naming the file and key) when it has no usable vocabulary."""
        if isinstance(file, str | os.PathLike):
            from accelplane.models.gguf import read_gguf

            file = read_gguf(file)
        path = getattr(file, "path", None)
        return cls(file.metadata, f"{path}: " if path else "")

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer of a metadata mapping (key -> MetaValue or plain value)."""
        return cls(md)

    # --- setup ----------------------------------------------------------------------------------
    def _setup_model(self, md: Mapping[str, Any], model: str, where: str) -> None:
        self.pre: str | None = None
        self.ranks: dict[tuple[str, str], int] = {}
        self.add_space_prefix = self.clean_spaces = self.ignore_merges = False
        self.add_bos = self.add_eos = self.add_sep = False
        self._patterns: tuple[str, ...] = ()
        if model == "gpt2":
            merges = _array(md, "tokenizer.ggml.merges", 0, (str,), where)
            if merges is None:
                raise TokenizerError(f"{where}a gpt2 (BPE) vocabulary needs tokenizer.ggml.merges, which is "
                                     "missing")  # fmt: skip
            for i, m in enumerate(merges):
                cut = m.find(" ", 1)
                pair = (m[:cut], m[cut + 1 :]) if cut >= 0 else ("", "")
                self.ranks.setdefault(pair, i)
            self.pre = _meta(md, "tokenizer.ggml.pre", str, None, where) or "default"
            pre = PRE_TOKENIZERS.get(self.pre)
            if pre is None:
                known = ", ".join("/".join(names[:2]) for names, _ in _GROUPS)
                raise TokenizerError(f"{where}tokenizer.ggml.pre {self.pre!r} is not a pre-tokenizer "
                                     f"accelplane knows ({known}; aliases in PRE_TOKENIZERS)")  # fmt: skip
            self._patterns, self.ignore_merges = pre.patterns, pre.ignore_merges
            self.clean_spaces, self.add_bos, self.add_sep = pre.clean_spaces, pre.add_bos, pre.add_sep
        elif model == "llama":
            self.add_space_prefix = self.add_bos = True
        else:  # bert
            self.clean_spaces = self.add_bos = self.add_sep = True
        self.add_space_prefix = _meta(md, "tokenizer.ggml.add_space_prefix", bool, self.add_space_prefix,
                                      where)  # fmt: skip
        self.lowercase = _meta(md, "tokenizer.ggml.normalizer.lowercase", bool, True, where)
        self.strip_accents = _meta(md, "tokenizer.ggml.normalizer.strip_accents", bool, self.lowercase, where)
        self._bpe_cache: dict[str, list[int]] = {}

    def _setup_special(self, md: Mapping[str, Any], model: str, where: str) -> None:
        n = self.n_vocab
        ids: dict[str, int | None] = dict.fromkeys(("bos", "eos", "unk", "sep", "pad", "mask", *_DETECT))
        ids.update({k: (v if v < n else None) for k, v in _DEFAULT_IDS[model].items()})
        for key, slot in _ID_KEYS:
            v = _meta(md, f"tokenizer.ggml.{key}_token_id", int, None, where)
            if v is not None and 0 <= v < n:  # llama.cpp ignores an id outside the vocabulary
                ids[slot] = v
        for flag in ("bos", "eos", "sep"):
            setattr(self, f"add_{flag}", _meta(md, f"tokenizer.ggml.add_{flag}_token", bool,
                                               getattr(self, f"add_{flag}"), where))  # fmt: skip
        for slot, texts in _DETECT.items():
            found = [self.token_to_id[t] for t in texts if t in self.token_to_id]
            if ids[slot] is None and found:
                ids[slot] = found[0]
                self.attrs[found[0]] |= Attr.CONTROL
        eog = {ids[s] for s in ("fim_pad", "fim_rep", "fim_sep") if ids[s] is not None}
        for t in _EOG_TEXTS & self.token_to_id.keys():
            eog.add(self.token_to_id[t])
            self.attrs[self.token_to_id[t]] |= Attr.CONTROL
        for t in _ALWAYS_USER_DEFINED:
            if t in self.token_to_id:
                self.attrs[self.token_to_id[t]] = Attr.USER_DEFINED
        eog |= {ids[s] for s in ("eos", "eot", "eom") if ids[s] is not None}
        self.eog = frozenset(eog)
        self.bos, self.eos, self.eot, self.eom = ids["bos"], ids["eos"], ids["eot"], ids["eom"]
        self.unk, self.sep, self.pad, self.mask = ids["unk"], ids["sep"], ids["pad"], ids["mask"]
        self._strip_rules(md)
        # text of special tokens, longest first: the order the text is searched for them
        special = [i for i, a in enumerate(self.attrs) if a & (_SPECIAL | Attr.USER_DEFINED)]
        self._special = sorted(special, key=lambda i: -len(self.tokens[i].encode()))

    def _strip_rules(self, md: Mapping[str, Any]) -> None:
        """llama.cpp's per-model LSTRIP/RSTRIP attributes (not in GGUF files: set by name)."""
        name = (_meta(md, "general.name", str, "") or "").lower()
        pre = _meta(md, "tokenizer.ggml.pre", str, "") or ""
        arch = _meta(md, "general.architecture", str, "") or ""

        def mark(text: str, attr: Attr, on: bool = True) -> None:
            i = self.token_to_id.get(text)
            if i is not None:
                self.attrs[i] = (self.attrs[i] | attr) if on else (self.attrs[i] & ~attr)

        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
                s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):  # fmt: skip
            mark("<mask>", Attr.LSTRIP)
        elif "phi-3" in name or "phi3" in name:
            for i, a in enumerate(self.attrs):
                if a & (_SPECIAL | Attr.USER_DEFINED):
                    self.attrs[i] |= Attr.RSTRIP
            mark("</s>", Attr.RSTRIP)
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                mark(t, Attr.RSTRIP, False)
        elif "modern-bert" in name:
            mark("[MASK]", Attr.LSTRIP)

    # --- encoding -------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (llama_tokenize): with ``add_special`` the model's BOS/EOS (and
        for BERT its CLS and SEP) as its flags say; with ``parse_special`` control tokens written
        in the text become their ids (user-defined tokens always do)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode: text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"encode: the text is not valid Unicode at character {e.start} "
                                 f"({text[e.start]!r} is a lone surrogate)") from None  # fmt: skip
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if self.model == "llama":
            if add_special and self.add_bos:
                out.append(self._need("bos"))
            prev_special = True
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                    continue
                s = (" " if self.add_space_prefix and prev_special else "") + f
                self._spm(s.replace(" ", _SPACE), out)
                prev_special = False
            if add_special and self.add_eos:
                out.append(self._need("eos"))
        elif self.model == "gpt2":
            if add_special and self.add_bos:
                out.append(self._need("bos"))
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    for piece in split_pieces(f, self._patterns):
                        out += self._bpe_word(byte_encode(piece))
            if add_special and self.add_eos:
                out.append(self._need("eos"))
        else:
            if add_special:
                out.append(self._need("bos"))
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    self._wpm(f, out)
            if add_special:
                out.append(self._need("sep"))
        return out

    def _need(self, slot: str) -> int:
        v = getattr(self, slot)
        if v is None:
            raise TokenizerError(f"{self._where}the vocabulary has no {slot.upper()} token, which "
                                 "add_special needs")  # fmt: skip
        return v

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """The text cut around the special tokens in it (tokenizer_st_partition): strings and ids."""
        frags: list[str | int] = [text]
        for tid in self._special:
            attr = self.attrs[tid]
            if not parse_special and attr & _SPECIAL:
                continue
            t = self.tokens[tid]
            if not any(isinstance(f, str) and t in f for f in frags):
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or t not in f:
                    out.append(f)
                    continue
                parts = f.split(t)
                for k, part in enumerate(parts):
                    if k and attr & Attr.RSTRIP:
                        part = part.lstrip(_ISSPACE)
                    if k < len(parts) - 1 and attr & Attr.LSTRIP:
                        part = part.rstrip(_ISSPACE)
                    if part:
                        out.append(part)
                    if k < len(parts) - 1:
                        out.append(tid)
            frags = out
        return frags

    def _byte_token(self, b: int) -> int:
        """The token of one byte: ``<0xXX>`` (or the byte itself) for SentencePiece, GPT-2's
        character for BPE."""
        keys = (f"<0x{b:02X}>", chr(b)) if self.model == "llama" else (BYTE_TO_UNICODE[b],)
        for k in keys:
            i = self.token_to_id.get(k)
            if i is not None:
                return i
        raise TokenizerError(f"{self._where}the vocabulary has no token for byte 0x{b:02X} ({keys[0]!r}), "
                             "which the text needs")  # fmt: skip

    def _spm(self, text: str, out: list[int]) -> None:
        """SentencePiece BPE by score (llm_tokenizer_spm_session)."""
        syms = list(text)
        n = len(syms)
        nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []
        tid, scores = self.token_to_id, self.scores

        def bigram(left: int, right: int) -> None:
            if left < 0 or right >= n:
                return
            i = tid.get(syms[left] + syms[right])
            if i is not None:
                heapq.heappush(heap, (-scores[i], left, right, len(syms[left]) + len(syms[right])))

        for i in range(1, n):
            bigram(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
                continue  # one of them was merged since
            syms[left] += syms[right]
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] < n:
                prv[nxt[right]] = left
            bigram(prv[left], left)
            bigram(left, nxt[left])
        i = 0
        while i < n:
            s = syms[i]
            t = tid.get(s)
            if t is not None:
                out.append(t)
            else:
                out += [self._byte_token(b) for b in s.encode("utf-8")]
            i = nxt[i]

    def _bpe_word(self, word: str) -> list[int]:
        """Byte-level BPE of one pre-tokenized, byte-encoded piece (llm_tokenizer_bpe_session)."""
        hit = self._bpe_cache.get(word)
        if hit is not None:
            return hit
        tid = self.token_to_id
        if self.ignore_merges and word in tid:
            res = [tid[word]]
        else:
            res = []
            for s in _bpe_merge(word, self.ranks):
                t = tid.get(s)
                if t is not None:
                    res.append(t)
                else:  # llama.cpp looks the symbol's UTF-8 bytes up one by one, skipping misses
                    res += [tid[c] for c in map(chr, s.encode("utf-8")) if c in tid]
        if len(self._bpe_cache) < 1 << 16:
            self._bpe_cache[word] = res
        return res

    def _wpm(self, text: str, out: list[int]) -> None:
        """WordPiece: greedy longest tokens of each word (llm_tokenizer_wpm_session)."""
        tid = self.token_to_id
        for word in _wpm_words(text, self.lowercase, self.strip_accents):
            w = (_SPACE + word).encode("utf-8")
            n, start, i = len(w), len(out), 0
            while i < n:
                for j in range(min(n, i + self.max_token_len + 1), i, -1):
                    t = tid.get(w[i:j].decode("utf-8", "ignore")) if _utf8_whole(w, i, j) else None
                    if t is not None:
                        out.append(t)
                        i = j
                        break
                else:
                    del out[start:]  # a word that cannot be cut is one unknown token
                    break
            if len(out) == start:
                out.append(self._need("unk"))

    # --- decoding -------------------------------------------------------------------------------
    def piece(self, tid: int, special: bool = False) -> bytes:
        """The bytes of token ``tid`` (llama_token_to_piece): a control or unknown token is
        empty unless ``special``."""
        tid = _token_id(tid, self.n_vocab)
        attr, text = self.attrs[tid], self.tokens[tid]
        if attr & _SPECIAL and not special:
            return b""
        if attr & (_SPECIAL | Attr.USER_DEFINED):
            return text.encode("utf-8")
        if attr & Attr.NORMAL:
            if self.model == "gpt2":
                return _byte_decode(text)
            return text.replace(_SPACE, " ").encode("utf-8")
        if attr & Attr.BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                raise TokenizerError(f"{self._where}byte token {tid} {text!r} is not of the form "
                                     "<0xXX>") from None  # fmt: skip
        return b""

    def decode_bytes(self, ids: Sequence[int], special: bool = False) -> bytes:
        """The bytes of ``ids`` as llama_detokenize(remove_special=False, unparse_special=special):
        one leading space of the first piece dropped where the tokenizer adds one, and for
        tokenizers that clean spaces, the space before ``? ! . ,`` and before some contractions."""
        out = bytearray()
        for k, t in enumerate(ids):
            p = self.piece(_token_id(t, self.n_vocab), special)
            if k == 0 and self.add_space_prefix and p[:1] == b" ":
                p = p[1:]
            out += p
        return _clean_spaces(bytes(out)) if self.clean_spaces else bytes(out)

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        """The text of ``ids`` (:meth:`decode_bytes`; bytes that are not UTF-8 become U+FFFD)."""
        return self.decode_bytes(ids, special).decode("utf-8", "replace")

    def stream(self, special: bool = False) -> StreamDecoder:
        """A decoder of generated ids one at a time (see :class:`StreamDecoder`)."""
        return StreamDecoder(self, special)

    def is_eog(self, tid: int) -> bool:
        """Whether ``tid`` ends generation (EOS, EOT, EOM and the like)."""
        return tid in self.eog

    def __repr__(self) -> str:
        pre = f" pre={self.pre!r}" if self.pre else ""
        return f"Tokenizer({self.model}{pre}, {self.n_vocab} tokens)"


def _token_id(t: Any, n: int) -> int:
    """``t`` as a token id (an int or numpy integer in [0, n)), else OutOfRangeError."""
    try:
        i = operator.index(t)
    except TypeError:
        i = None
    if i is None or isinstance(t, bool | np.bool_) or not 0 <= i < n:
        raise OutOfRangeError(f"token id {t!r} is not an integer in the vocabulary (0 .. {n - 1})")
    return i


def _bpe_merge(word: str, ranks: Mapping[tuple[str, str], int]) -> list[str]:
    """The symbols of ``word`` after merging its pairs by rank, lowest first (the left one first
    on a tie), as llm_tokenizer_bpe_session."""
    syms = list(word)
    n = len(syms)
    nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))
    heap: list[tuple[int, int, int, str]] = []

    def bigram(left: int, right: int) -> None:
        if left < 0 or right >= n:
            return
        r = ranks.get((syms[left], syms[right]))
        if r is not None:
            heapq.heappush(heap, (r, left, right, syms[left] + syms[right]))

    for i in range(1, n):
        bigram(i - 1, i)
    while heap:
        _, left, right, text = heapq.heappop(heap)
        if not syms[left] or not syms[right] or syms[left] + syms[right] != text:
            continue
        syms[left] = text
        syms[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] < n:
            prv[nxt[right]] = left
        bigram(prv[left], left)
        bigram(left, nxt[left])
    return [s for s in syms if s]


def _wpm_words(text: str, lowercase: bool, strip_accents: bool) -> list[str]:
    """llm_tokenizer_wpm_session::preprocess: the normalized words of ``text``."""
    words = [""]
    for ch in text:
        c = _first_nfd(ch) if strip_accents else ch
        cat = _category(c)
        if c in _WHITESPACE:
            if words[-1]:
                words.append("")
            continue
        if c in ("\0", "\ufffd") or cat == "C":
            continue
        if strip_accents and cat == "M":
            continue
        s = _lower(c) if lowercase else c
        if cat == "P" or (ord(c) < 0x7F and cat == "S") or _is_cjk(ord(c)):
            if words[-1]:
                words.append("")
            words[-1] = s
            words.append("")
        else:
            words[-1] += s
    return [w for w in words if w]


class StreamDecoder:
    """Text of ids fed one at a time, as each token's piece (no leading-space removal or space
    cleaning, as llama.cpp streams): :meth:`feed` returns what can be shown now, holding back
    the bytes of a character split across tokens; :meth:`flush` returns what is left."""

    def __init__(self, tok: Tokenizer, special: bool = False) -> None:
        self.tok, self.special = tok, special
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tid: int) -> str:
        return self._dec.decode(self.tok.piece(tid, self.special))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


# --- character classes (llama.cpp's unicode_cpt_flags, from the regex package) -------------------
_WHITESPACE = frozenset(map(chr, [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                                  0x2028, 0x2029, 0x202F, 0x205F, 0x3000]))  # fmt: skip


@lru_cache(maxsize=1 << 16)
def _category(c: str) -> str:
    """The major general category of ``c`` by the regex package: L, M, N, P, S, Z, C (control,
    format, private use, surrogate) or Cn (unassigned)."""
    m = _compiled(r"(?P<L>\p{L})|(?P<M>\p{M})|(?P<N>\p{N})|(?P<P>\p{P})|(?P<S>\p{S})|(?P<Z>\p{Z})"
                  r"|(?P<Cn>\p{Cn})").fullmatch(c)
    return m.lastgroup if m is not None else "C"


@lru_cache(maxsize=1 << 16)
def _first_nfd(c: str) -> str:
    """llama.cpp's "NFD": the first code point of the character's canonical decomposition."""
    return unicodedata.normalize("NFD", c)[0]


@lru_cache(maxsize=1 << 16)
def _lower(c: str) -> str:
    """The simple lowercase mapping (one code point), as llama.cpp's unicode_tolower."""
    lo = c.lower()
    return lo if len(lo) == 1 else lo[0]


def _byte_decode(text: str) -> bytes:
    """The bytes GPT-2's characters stand for (llama_decode_text; a character outside the map
    gives llama.cpp's ``[UNK_BYTE_0x..]`` marker)."""
    out = bytearray()
    for c in text:
        b = UNICODE_TO_BYTE.get(c)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + c.encode().hex().encode() + text.encode() + b"]"
    return bytes(out)


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)  # fmt: skip


def _utf8_whole(b: bytes, i: int, j: int) -> bool:
    """Whether bytes [i, j) of UTF-8 ``b`` start and end on character boundaries (a token's text is
    whole characters, so nothing else can match)."""
    return (b[i] & 0xC0) != 0x80 and (j == len(b) or (b[j] & 0xC0) != 0x80)


def _clean_spaces(text: bytes) -> bytes:
    """llama_detokenize's clean-up, pass for pass: drop the space before ``? ! . ,``; the spaces
    around a lone ``'``; the space before ``'s``, ``'m``, ``'re``, ``'ve``."""
    if not text:
        return text
    t, out = text, bytearray(text[:1])
    for i in range(1, len(t)):
        if t[i - 1] == 0x20 and t[i] in b"?!.,":
            out.pop()
        out.append(t[i])
    t, out = bytearray(out), bytearray(out[:1])
    i = 1
    while i < len(t):
        x = t[i]
        if x == 0x27 and i + 1 < len(t) and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            out.pop()
            i += 1
            t[i] = 0  # the space after it goes too, and is no space for what follows
        out.append(x)
        i += 1
    t, out = bytes(out), bytearray(out[:1])
    for i in range(1, len(t)):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < len(t):
            x1, x2 = t[i + 1], (t[i + 2] if i + 2 < len(t) else None)
            if x1 in b"sm" or (x1, x2) in ((0x72, 0x65), (0x76, 0x65)):  # 's 'm 're 've
                out.pop()
        out.append(x)
    return bytes(out)


__all__ = ["Attr", "PRE_TOKENIZERS", "PreTokenizer", "StreamDecoder", "Tokenizer", "byte_encode",
           "split_pieces"]  # fmt: skip
