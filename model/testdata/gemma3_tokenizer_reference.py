"""Writes gemma3_tokenizer_reference.json: Gemma 3's token ids for a few
texts, from Hugging Face's tokenizer built from the same GGUF file
(transformers 5.x: a BPE model with byte fallback, merges rebuilt from the
vocabulary in score order, added tokens split first).

Run from the repository root after scripts/fetch_gemma3.sh:
  python3 model/testdata/gemma3_tokenizer_reference.py
"""
import json

import transformers
from transformers import AutoTokenizer

MODEL_DIR = "models_cache/gemma3-270m"
GGUF = "gemma-3-270m-q4_k_m.gguf"

TEXTS = [
    "Hello world",
    "It is a truth universally acknowledged, that a single man in possession "
    "of a good fortune, must be in want of a wife.",
    "  two leading spaces, a  double,    four and" + " " * 40 + "forty spaces",
    "line one\nline two\n\nnew paragraph\n\n\n\nfour newlines\r\nwindows\n",
    "\ttab\t\ttwo tabs\t \tmixed\n    indented code();",
    "In 2024, 3.14159 x 1,000,000 = 3141590; call 555-0123 or +1 (800) 42.",
    "Wait... what?! (Yes) - [no] {maybe}; \"quoted\" 'single' @#$%^&*_+=|\\/<>~`",
    "Caf\u00e9 na\u00efve fa\u00e7ade, \u00c6r\u00f8sk\u00f8bing, S\u00e3o Paulo, "
    "cr\u00e8me br\u00fbl\u00e9e, Z\u00fcrich, \u0395\u03bb\u03bb\u03b7\u03bd"
    "\u03b9\u03ba\u03ac, \u0420\u0443\u0441\u0441\u043a\u0438\u0439 "
    "\u0442\u0435\u043a\u0441\u0442",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002"
    "\u4e2d\u6587\u6587\u672c\uff0c\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "I love pizza \U0001f355\U0001f355 and \U0001f469\u200d\U0001f469\u200d"
    "\U0001f467 families! \U0001f389",
    # Not in the vocabulary: byte fallback.
    "a troll \U0001f9cc, a hieroglyph \U00013000 and \U00020000\u0378.",
    "<table><tr><td>cell</td></tr></table> <b>bold</b> <start_of_image>",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "literal <0x41> and <bos and <unused0 text",
]


def main():
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF)
    cases = []
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == 2, "expected BOS 2 first"
        assert tok.decode(ids, skip_special_tokens=False).startswith("<bos>")
        case = {"text": text, "ids": ids}
        # A run of more than 31 spaces: Hugging Face's Gemma tokenizer merges
        # the spaces as BPE pieces (40 -> 16 + 24), while llama.cpp (and
        # SentencePiece) split the user-defined runs longest first
        # (40 -> 31 + 9, ids 167 and 145).
        forty = [136 + 16, 136 + 24]
        if " " * 40 in text:
            i = next(k for k in range(len(ids)) if ids[k:k + 2] == forty)
            case["llama_cpp_ids"] = ids[:i] + [136 + 31, 136 + 9] + ids[i + 2:]
            case["note"] = ("40 spaces: Hugging Face merges them as BPE pieces "
                            "(16 + 24 spaces); llama.cpp splits user-defined "
                            "runs longest first (31 + 9)")
        cases.append(case)
    # No dummy prefix: "Hello" is not "\u2581Hello".
    assert tok.convert_ids_to_tokens(tok("Hello")["input_ids"])[1] == "Hello"
    out = {
        "source": "transformers %s AutoTokenizer.from_pretrained(%r, "
        "gguf_file=%r); ids include BOS" % (transformers.__version__, MODEL_DIR,
                                           GGUF),
        "cases": cases,
    }
    with open("model/testdata/gemma3_tokenizer_reference.json", "w",
              encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
