"""In-process services on a model folder, the texts the tests embed with them, and the float64
reference their vectors are checked against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from embedserve.handler.assembly import assemble
from embedserve.handler.torchserve.profile import TORCHSERVE
from embedserve.handler.service import EmbeddingService
from embedserve.handler.settings import Settings

TEXTS = [
    "hello world",
    "the cat sat on the mat",
    "a",
    "embedding server batch request token text vector search query document " * 6,  # truncated at 48
    "Ünïcode: 漢字 日本語 ñ ç ß",
    "one two three",
]


def make_engine(model_dir: Path, **settings) -> EmbeddingService:
    """A service on one CPU thread, cold: tests that need the measured speed warm it up themselves."""
    config = Settings.from_mapping({"device": "cpu", "cpu_threads": 1, **settings})
    return assemble(model_dir, config, model_name="tiny", cuda_available=False, warm=False, server=TORCHSERVE)


def float64_reference(model_dir, texts, max_length=48, pooling="mean", normalize=True):
    """Each text alone through transformers in float64: no padding, no batching."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float64).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")["input_ids"]
            hidden = model(input_ids=ids).last_hidden_state[0]
            row = {"mean": hidden.mean(0), "cls": hidden[0], "last_token": hidden[-1]}[pooling]
            rows.append(torch.nn.functional.normalize(row, dim=0) if normalize else row)
    return torch.stack(rows).numpy()


def matrix(body):
    """The vectors of an answer's body, in the order of its `data`."""
    return np.array([d["embedding"] for d in body["data"]])
