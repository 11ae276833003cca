"""The bundled offline corpus and tokenizer, which every TorchTitan edge registers.

TorchTitan ships neither a tokenizer nor a dataset, and training machines may
not download any, so the package carries both (``titan_uniep/assets``, made by
``assets/make_assets.py``):

- the dataset ``"uniep_corpus"`` (``DATASET_NAME``): CPython stdlib sources,
  ~0.84M tokens, read from the installed package, so any working directory
  works. TorchTitan's text dataloader loops over it (``infinite=True``), so
  long runs never run out of data; 50 steps of 4 x 256 tokens on 2 ranks use
  an eighth of it.
- the tokenizer folder ``titan_uniep/assets/bpe2048`` (``ASSETS_DIR``, a
  train config's ``hf_assets_path``): byte-level BPE with 2048 tokens, the
  vocab_size of the debug flavors.

``register_dataset`` adds ``DATASET_NAME`` to TorchTitan's dataset table
(``hf_datasets.text_datasets.DATASETS``, the same table in 0.2.2 and 0.3.0);
each edge calls it when it is imported.
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

_ASSETS = Path(__file__).resolve().parents[1] / "assets"

ASSETS_DIR = str(_ASSETS / "bpe2048")
"""Tokenizer folder for ``hf_assets_path`` (tokenizer.json, tokenizer_config.json)."""

CORPUS_PATH = str(_ASSETS / "corpus.jsonl")
"""JSON lines, one document per line: ``{"source": "Lib/x.py", "text": "..."}``."""

DATASET_NAME = "uniep_corpus"


def load_corpus(path: str) -> Dataset:
    """The corpus as an in-memory map-style ``datasets.Dataset`` with a "text" column.

    Built from the file directly rather than ``load_dataset("json", ...)``:
    no cache folder, no lock shared between ranks, no hub lookup.
    """
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return Dataset.from_dict({"text": texts})


def document_text(sample: dict) -> str:
    """A corpus sample's text (TorchTitan's ``sample_processor``)."""
    return sample["text"]


def register_dataset() -> None:
    """Add ``"uniep_corpus"`` to TorchTitan's dataset table; calling it again is a no-op."""
    DATASETS.setdefault(
        DATASET_NAME,
        DatasetConfig(path=CORPUS_PATH, loader=load_corpus, sample_processor=document_text),
    )
