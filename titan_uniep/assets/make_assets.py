"""Regenerate the bundled corpus and tokenizer: ``python titan_uniep/assets/make_assets.py``.

Training runs must not download anything, and every machine must see the same
tokens, so the corpus and the tokenizer are files in the repository; this
script is how they were made, not something a run calls.

- ``corpus.jsonl``: one JSON object per line, ``{"source": "Lib/x.py", "text": ...}``,
  the source of a fixed list of CPython standard-library modules (real,
  well-commented text; PSF license, copied next to it as PYTHON_LICENSE.txt).
  The text depends on the interpreter's stdlib, so the shipped file, made with
  the version in ``MANIFEST.json``, is the reference: regenerating under
  another Python changes it.
- ``bpe2048/tokenizer.json`` + ``tokenizer_config.json``: byte-level BPE with
  exactly 2048 tokens (the vocab_size of TorchTitan's debug models), BOS/EOS
  included, in the layout ``model.hf_assets_path`` expects.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS_DIR = Path(__file__).resolve().parent
VOCAB_SIZE = 2048
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

# Pure-Python modules, long and documented, present in 3.10-3.13; ~2 MB in all.
STDLIB_MODULES = (
    "argparse", "ast", "base64", "bdb", "calendar", "codecs", "collections/__init__",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "difflib", "doctest", "email/message", "enum", "fractions", "ftplib",
    "functools", "gettext", "gzip", "heapq", "inspect", "ipaddress",
    "json/decoder", "json/encoder", "locale", "logging/__init__", "mailbox",
    "ntpath", "operator", "optparse", "os", "pathlib", "pickle", "platform",
    "pprint", "queue", "random", "shutil", "smtplib", "socket", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "tokenize", "traceback", "typing", "unittest/case", "uuid", "weakref",
    "zipfile",
)


def read_corpus(stdlib: Path) -> list[dict[str, str]]:
    docs = []
    for name in STDLIB_MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():  # zipfile became a package in 3.12
            path = stdlib / name / "__init__.py"
        docs.append({"source": f"Lib/{path.relative_to(stdlib)}", "text": path.read_text("utf-8")})
    return docs


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    return tokenizer


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS_DIR, help="folder to write (default: this package's assets)")
    args = parser.parse_args()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = read_corpus(stdlib)
    out = args.out
    tok_dir = out / "bpe2048"
    tok_dir.mkdir(parents=True, exist_ok=True)

    corpus = out / "corpus.jsonl"
    with corpus.open("w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    (out / "PYTHON_LICENSE.txt").write_text((stdlib / "LICENSE.txt").read_text("utf-8"), "utf-8")

    tokenizer = train_tokenizer([d["text"] for d in docs])
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    # TorchTitan's HuggingFaceTokenizer reads BOS/EOS from here; its dataset
    # asks for both explicitly (add_bos=True, add_eos=True) on every document.
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True,
              "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    num_tokens = sum(len(tokenizer.encode(d["text"]).ids) + 2 for d in docs)
    manifest = {
        "python": platform.python_version(),
        "documents": len(docs),
        "bytes": corpus.stat().st_size,
        "tokens": num_tokens,
        "sha256": {p: sha256(out / p) for p in ("corpus.jsonl", "bpe2048/tokenizer.json")},
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
