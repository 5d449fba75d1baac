#!/usr/bin/env python3
"""Reference token ids from llama.cpp for accelplane's tokenizer tests, and a live comparison.

    python tools/tokenizer_refs.py write   --llama-cpp DIR [--out tests/data/tokenizer]
    python tools/tokenizer_refs.py compare --llama-cpp DIR [--random N] [VOCAB ...]

DIR is a llama.cpp source tree: its ``models/ggml-vocab-NAME.gguf`` are vocabulary-only GGUF
files of real models. Both commands need llama.cpp's Python binding (``llama_cpp``) over a
build of that tree, and use ``llama_tokenize`` / ``llama_detokenize`` as the oracle.

``write``: for each vocabulary of :data:`VOCABS` makes a trimmed copy, ``NAME.gguf`` in the
output directory, with the pre-tokenizer VOCABS gives it: every token that is not a normal one
(control, byte, user-defined, ...) and every normal token whose text occurs in the test texts
(:data:`TEXTS`), the ids up to the model type's default special ids (BERT's CLS is 101 without
a key), and the merges among them, in the original order (so the test texts tokenize as with
the whole vocabulary, under new ids). It is made deterministically from the source file. Then
``refs.json`` gets, per vocabulary, llama.cpp's ids for each text under each (add_special,
parse_special), its decoding of them, its BOS/EOS/end-of-generation ids, and for a vocabulary
under its own pre-tokenizer the ids of the whole vocabulary (with the source file's SHA-256,
for tests given the real file). The tests need neither llama.cpp nor the real files.

``compare``: accelplane's tokenizer against llama.cpp on the whole vocabularies (default: every
``ggml-vocab-*.gguf`` accelplane supports), over the test texts, llama.cpp's own test texts
(``*.gguf.inp``) and ``--random`` seeded random texts; prints the agreement per vocabulary and
the first disagreement. Exit status 1 when any text disagrees.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import random
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sdk"))

from accelplane.errors import TokenizerError  # noqa: E402
from accelplane.models.gguf import MetaValue, read_gguf, write_gguf  # noqa: E402
from accelplane.models.tokenizer import _DEFAULT_IDS, UNICODE_TO_BYTE, Tokenizer  # noqa: E402

# the vocabularies trimmed for the tests (SentencePiece, byte-level BPE with each pre-tokenizer
# family, WordPiece): name -> (the ggml-vocab-SOURCE.gguf it is cut from, the tokenizer.ggml.pre
# it is given, None: its own). Only vocabularies of permissively licensed models (MIT, Apache-2.0)
# are committed; the other pre-tokenizers run over one of them.
VOCABS: dict[str, tuple[str, str | None]] = {
    "phi-3": ("phi-3", None),  # SentencePiece with byte fallback (MIT)
    "bert-bge": ("bert-bge", None),  # WordPiece (MIT)
    "qwen2": ("qwen2", None),  # Apache-2.0
    "gpt-2": ("gpt-2", None),  # MIT
    "falcon": ("falcon", None),  # Apache-2.0
    "gpt-neox": ("gpt-neox", None),  # Apache-2.0
    "llama-bpe": ("qwen2", "llama-bpe"),  # Llama 3's pre-tokenizer over Qwen2's byte-level BPE
    "starcoder": ("gpt-2", "starcoder"),
    "deepseek-coder": ("gpt-2", "deepseek-coder"),
    "deepseek-llm": ("gpt-2", "deepseek-llm"),
}
# (add_special, parse_special) of each reference
MODES = ((True, False), (False, False), (True, True), (False, True))

TEXTS = [
    "Hello world",
    " Hello World!",
    "Hello, y'all! How are you? I'm fine, we've got 'em. She'd say it's OK. THEY'RE HERE.",
    "The quick brown fox jumps over the lazy dog.",
    "Über die Brücke gehen Mädchen und Jungen; Straße, Größe, Öl, Ärger.",
    "我们今天去公园散步，天气很好。机器学习和人工智能。",
    "日本語のテキスト：東京は大きな都市です。カタカナとひらがな。",
    "Привет, мир! Как дела? Съешь ещё этих мягких французских булок.",
    "مرحبا بالعالم، كيف حالك؟ اللغة العربية جميلة.",
    "Emoji: 🦙🚀 😀😃 👍🏽 👨‍👩‍👧‍👦 🇩🇪 ❤️ ✅",
    "Digits: 3 33 333 3333 33333 123456789 3.14159 1,000,000 2024-01-02 ٣٤٥ ५६७",
    "Tabs\tand\t\ttabs, spaces:  two   three    four.\nNew lines\n\nand\n\n\nmore\r\nCRLF\r\n",
    "   leading spaces and trailing spaces   ",
    "\n\n\t\n  \t  \n",
    "    def f(x):\n        return x ** 2  # comment\n\tif (a && b) { c++; }",
    "Ça va? Tiếng Việt có dấu. Ελληνικά. עברית. हिन्दी भाषा. 한국어 텍스트.",
    "!!!!!! ...... ?????? ------====== '''''' \"\"\"\"\"\" ``````",
    "<s>Hello</s> <unk> [CLS] text [SEP] [MASK] <|endoftext|> <|im_start|>user\nHi<|im_end|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "Mixed: naïve café résumé coöperate façade — “quotes” and ‘single’ … ½ € ™ ©",
]


# --- the oracle ------------------------------------------------------------------------------
class LlamaCpp:
    """One vocabulary through llama.cpp's C API (vocab_only)."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.lib = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        b = text.encode()
        cap = len(b) + 8
        buf = (self.lib.llama_token * cap)()
        n = self.lib.llama_tokenize(self.vocab, b, len(b), buf, cap, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens")
        return list(buf[:n])

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (self.lib.llama_token * max(1, len(ids)))(*ids)
        cap = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(cap)
        n = self.lib.llama_detokenize(self.vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
        if n < 0:
            raise RuntimeError(f"llama_detokenize needs {-n} bytes")
        return buf.raw[:n]

    def special(self) -> dict:
        lib, v = self.lib, self.vocab
        null = lambda t: None if t < 0 else int(t)  # noqa: E731
        return {"bos": null(lib.llama_vocab_bos(v)), "eos": null(lib.llama_vocab_eos(v)),
                "eot": null(lib.llama_vocab_eot(v)), "sep": null(lib.llama_vocab_sep(v)),
                "add_bos": bool(lib.llama_vocab_get_add_bos(v)),
                "add_eos": bool(lib.llama_vocab_get_add_eos(v)),
                "eog": [i for i in range(self.n) if lib.llama_vocab_is_eog(v, i)]}  # fmt: skip

    def close(self) -> None:
        self.lib.llama_model_free(self.model)


def quiet_llama_cpp() -> None:
    """Silence llama.cpp's loader log (it writes to stderr for every file)."""
    import llama_cpp

    @llama_cpp.llama_log_callback
    def _drop(level, text, user_data):  # pragma: no cover - called from C
        pass

    quiet_llama_cpp.cb = _drop  # keep it alive
    llama_cpp.llama_log_set(_drop, ctypes.c_void_p(0))


# --- trimming ----------------------------------------------------------------------------------
def _surfaces(model: str, texts: list[str]) -> tuple[list[str], list[bytes]]:
    """The strings a kept token's text must occur in: the texts as the model's tokens spell them."""
    if model == "llama":
        strs = [v for t in texts for v in ("▁" + t.replace(" ", "▁"), t.replace(" ", "▁"))]
    else:  # bert: the words as its normalizer leaves them
        def strip(s: str) -> str:
            return "".join(c for c in unicodedata.normalize("NFD", s) if unicodedata.category(c) != "Mn")

        strs = [v for t in texts for v in (t, t.lower(), strip(t.lower()))]
    return strs, [t.encode() for t in texts]


def trim(src: Path, texts: list[str]) -> dict[str, MetaValue]:
    """The metadata of ``src`` with its vocabulary cut to what ``texts`` need (see the module
    docstring); other tokenizer.* arrays (chat templates, charsmaps) are dropped."""
    f = read_gguf(src)
    md = f.metadata
    model = md["tokenizer.ggml.model"].value
    toks = md["tokenizer.ggml.tokens"].value
    types = md["tokenizer.ggml.token_type"].value if "tokenizer.ggml.token_type" in md else [1] * len(toks)
    strs, raw = _surfaces(model, texts)

    def occurs(t: str) -> bool:
        if model == "gpt2":
            b = bytes(UNICODE_TO_BYTE.get(c, 0) for c in t)
            return len(b) == 1 or any(b in r for r in raw)
        t = t[1:] if model == "bert" and t.startswith("▁") and len(t) > 1 else t
        return any(t in s for s in strs)

    # the ids up to the model type's default special ids stay, so the defaults still hold
    low = max(_DEFAULT_IDS[model].values())
    keep = [i for i, (t, ty) in enumerate(zip(toks, types, strict=False)) if i <= low or ty != 1 or occurs(t)]
    new_id = {old: new for new, old in enumerate(keep)}
    kept = {toks[i] for i in keep}
    out: dict[str, MetaValue] = {}
    for k, mv in md.items():
        if k.startswith("tokenizer.") and not k.startswith("tokenizer.ggml."):
            continue  # chat templates, the HF json
        if k in ("tokenizer.ggml.precompiled_charsmap",):
            continue
        if k.endswith("_token_id"):
            if mv.value in new_id:
                out[k] = MetaValue(new_id[mv.value], mv.type)
            continue
        if k.endswith(".vocab_size"):
            out[k] = MetaValue(len(keep), mv.type)
            continue
        if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            out[k] = MetaValue([mv.value[i] for i in keep], mv.type, mv.sub_type)
            continue
        if k == "tokenizer.ggml.merges":
            ms = []
            for m in mv.value:
                a, _, b = m.partition(" ")
                if a in kept and b in kept and occurs(a + b):
                    ms.append(m)
            out[k] = MetaValue(ms, mv.type, mv.sub_type)
            continue
        out[k] = mv
    f.close()
    return out


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def references(path: Path, texts: list[str]) -> dict:
    o = LlamaCpp(path)
    try:
        ids = {f"{int(a)}{int(s)}": [o.tokenize(t, a, s) for t in texts] for a, s in MODES}
        # the ids with and without BOS, decoded hiding and showing control tokens: MODE + SPECIAL
        dec = {f"{m}{int(s)}": [o.detokenize(x, False, s).hex() for x in ids[m]]
               for m in ("11", "01") for s in (False, True)}  # fmt: skip
        return {"ids": ids, "decode": dec, **o.special()}
    finally:
        o.close()


def cmd_write(args) -> int:
    models = Path(args.llama_cpp) / "models"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    refs: dict = {"texts": TEXTS, "modes": [f"{int(a)}{int(s)}" for a, s in MODES], "vocabs": {}}
    for name, (source, pre) in VOCABS.items():
        src = models / f"ggml-vocab-{source}.gguf"
        small = out / f"{name}.gguf"
        md = trim(src, TEXTS)
        if pre is not None:
            md["tokenizer.ggml.pre"] = MetaValue(pre, md["tokenizer.ggml.pre"].type)
        write_gguf(small, md, [])
        r = references(small, TEXTS)
        if pre is None:  # the whole vocabulary's ids, for tests given the real file
            full = references(src, TEXTS)
            r["full"] = {"sha256": sha256(src), "ids": full["ids"], "eog": full["eog"]}
        refs["vocabs"][name] = r
        n = len(read_gguf(small).metadata["tokenizer.ggml.tokens"].value)
        print(f"{name}: {n} tokens, {small.stat().st_size / 1024:.0f} KiB")
    (out / "refs.json").write_text(json.dumps(refs, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {out / 'refs.json'}")
    return 0


# --- live comparison -----------------------------------------------------------------------------
_ALPHABETS = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "äöüßÄÖÜéèêàçñøå", "0123456789",
              " ", "  \t\n\r", ".,;:!?'\"-_()[]{}<>/\\|@#$%^&*+=~`", "我们今天去公园散步天气很好機械学習",
              "あいうえおカタカナ東京", "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВ",
              "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
              "🦙🚀😀👍🏽❤️✅\u200d\ufe0f", "ελληνικάעבריתहिन्दी한국어"]  # fmt: skip


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            a = rng.choice(_ALPHABETS)
            parts.append("".join(rng.choice(a) for _ in range(rng.randint(1, 8))))
        out.append("".join(parts))
    return out


def llama_cpp_texts(models: Path) -> list[str]:
    texts: list[str] = []
    for p in sorted(models.glob("*.gguf.inp")):
        texts += [t[:-1] if t.endswith("\n") else t for t in p.read_text().split("\n__ggml_vocab_test__\n")]
    return list(dict.fromkeys(texts))


def compare_one(path: Path, texts: list[str]) -> tuple[str, int, int, str]:
    try:
        tok = Tokenizer.from_gguf(path)
    except TokenizerError as e:
        return "-", 0, 0, f"not supported: {e}"
    o = LlamaCpp(path)
    agree, total, first = 0, 0, ""
    try:
        for t in texts:
            for a, s in MODES:
                want, got = o.tokenize(t, a, s), tok.encode(t, a, s)
                total += 1
                ok = want == got
                if ok and a and s:
                    ok = tok.decode_bytes(got) == o.detokenize(got, False, False)
                agree += ok
                if not ok and not first:
                    first = (f"{t!r} (add_special={a}, parse_special={s}): llama.cpp {want[:12]}, "
                             f"accelplane {got[:12]}")  # fmt: skip
    finally:
        o.close()
    kind = tok.model + (f"/{tok.pre}" if tok.pre else "")
    return kind, agree, total, first


def cmd_compare(args) -> int:
    models = Path(args.llama_cpp) / "models"
    names = args.vocab or sorted(p.name[len("ggml-vocab-") : -5] for p in models.glob("ggml-vocab-*.gguf"))
    texts = TEXTS + llama_cpp_texts(models) + random_texts(args.random, args.seed)
    bad = 0
    print(f"{len(texts)} texts x {len(MODES)} (add_special, parse_special); decode checked once per text")
    for name in names:
        kind, agree, total, first = compare_one(models / f"ggml-vocab-{name}.gguf", texts)
        print(f"{name:<16} {kind:<22} {agree}/{total}" + (f"  first difference: {first}" if first else ""))
        bad += bool(first) and total > 0
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="trimmed vocabularies and refs.json for the tests")
    w.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (its models/ directory)")
    w.add_argument("--out", default=str(ROOT / "tests" / "data" / "tokenizer"))
    c = sub.add_parser("compare", help="accelplane vs llama.cpp on the whole vocabularies")
    c.add_argument("--llama-cpp", required=True)
    c.add_argument("--random", type=int, default=200, help="random texts (default 200)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("vocab", nargs="*", help="vocabulary names (default: every ggml-vocab-*.gguf)")
    args = p.parse_args(argv)
    quiet_llama_cpp()
    return cmd_write(args) if args.cmd == "write" else cmd_compare(args)


if __name__ == "__main__":
    sys.exit(main())
