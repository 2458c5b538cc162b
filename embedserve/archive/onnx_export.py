"""Export the transformer to ONNX for the CPU engine (embedserve/handler/backends/onnx_runtime.py), at build time.

The model's own float32 weights are traced once (eager attention, which ONNX Runtime's
transformer optimizer recognizes and fuses into its Attention, BiasGelu and
EmbedLayerNormalization kernels) and written beside the safetensors as
`model/transformer.onnx`: protobuf, no pickle. The graph outputs the last hidden states; pooling
and the sentence-transformers head stay in torch, shared with every other engine.

The export is checked against the torch model on inputs of several lengths; an architecture
that does not export, or whose export does not match, is served by torch instead, and the build
says so. Measured on all-MiniLM-L6-v2, 2-core CPU: docs/performance.md.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

from embedserve.handler.backends.onnx_runtime import (ONNX_FILE, TEXT_TOWER_ONNX_FILE, VISION_ONNX_FILE, OnnxImageTower,
                                                      OnnxTextTower, OnnxTransformer)
from embedserve.handler.model.tokenization import TextTokenizer
from embedserve.handler.model.towers import ImageTower, TextFeed, TextTower

# The largest difference of a hidden state (any token, any unit) to torch that is accepted.
MAX_ABS_DIFFERENCE = 1e-3


class _LastHiddenState(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class _Logits(torch.nn.Module):
    """A scoring model's graph: its logits, from token types too where it takes them."""

    def __init__(self, model: torch.nn.Module, segments: bool):
        super().__init__()
        self.model = model
        self.segments = segments

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = {"token_type_ids": token_type_ids} if self.segments else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits


def export_onnx(model_dir: Path, max_positions: int | None, *, scoring: bool = False, segments: bool = False) -> str:
    """Write model_dir/transformer.onnx and return what was done, or why not (then no file).
    `scoring`: the graph gives the sequence-classification logits, from token types too with
    `segments`."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    target = model_dir / ONNX_FILE
    auto = AutoModelForSequenceClassification if scoring else AutoModel
    try:
        model = auto.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32,
                                     use_safetensors=True).eval()
    except (ValueError, ImportError, OSError) as err:
        return f"not exported (the model does not load with eager attention: {err}); served by torch"
    graph = _Logits(model, segments) if scoring else _LastHiddenState(model)
    # The reference comes first: tracing leaves the model object altered (measured: its later
    # outputs differ), so it is never run after the export.
    ids, mask = _probe_batch(int(model.config.vocab_size), max_positions or 512)
    types = (torch.arange(ids.shape[1]) >= ids.shape[1] // 2).long().expand_as(ids) * mask if segments else None
    probe = (ids, mask, types) if segments else (ids, mask)
    with torch.inference_mode():
        expected = graph(*probe)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "raw.onnx"
            trace_to_onnx(graph, raw, segments=segments)
            fusions = _optimize(raw, target, model.config)
    except Exception as err:  # any exporter or optimizer failure: torch serves this model
        target.unlink(missing_ok=True)
        return f"not exported ({type(err).__name__}: {str(err)[:200]}); served by torch"
    served = OnnxTransformer(target, threads=1)(*probe)
    if scoring:
        difference = float((served - expected).abs().max())
    else:
        real = mask.bool()
        difference = float((served[real] - expected[real]).abs().max())
    if difference > MAX_ABS_DIFFERENCE:
        target.unlink()
        what = "logits" if scoring else "hidden states"
        return f"not used: its {what} differ from torch by {difference:.1e}; served by torch"
    return f"exported ({fusions}; max difference to torch {difference:.1e})"


class _ImageFeatures(torch.nn.Module):
    """An image-text model's vision tower as the worker runs it in torch (model/towers.py)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return ImageTower(self.model)(pixel_values)


class _TextFeatures(torch.nn.Module):
    """An image-text model's text tower as the worker runs it in torch, after the feed (model/towers.py)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return TextTower(self.model)(input_ids, attention_mask)


# Texts of several lengths, for the text tower's check: padded in one batch, as workers pad them.
TOWER_PROBE_TEXTS = ("a", "two dogs in the snow", "a photograph of a red cat asleep on a wooden table by the "
                     "window in the soft light of a winter morning, " * 3)


def export_towers_onnx(model_dir: Path, text_length: int | None) -> str:
    """Write model_dir/vision.onnx and model_dir/text_tower.onnx, an image-text model's towers
    (pixel values, or ids and mask, to projected features; dynamic in batch and length), and return
    what was done for each, or why not (then no file: torch runs that tower). Each is checked
    against torch, as the text encoders' export is: images on random pixels, texts on the folder's
    own tokenizer's ids of several lengths fed as workers feed them (`text_length`: SigLIP's fixed
    length, model/towers.py)."""
    from transformers import AutoModel, AutoTokenizer

    try:
        model = AutoModel.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32,
                                          use_safetensors=True).eval()
    except (ValueError, ImportError, OSError) as err:
        return f"not exported (the model does not load with eager attention: {err}); served by torch"
    size = getattr(model.config.vision_config, "image_size", None)  # none: SigLIP 2 NaFlex, any shape
    pixels = torch.randn((3, 3, size or 1, size or 1), generator=torch.Generator().manual_seed(0))
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer = TextTokenizer(model_dir, hf_tokenizer=hf_tokenizer)
    feed = TextFeed(text_length, tokenizer.pad_id, tokenizer.gives_attention_mask, tokenizer.pads_left)
    encoded = hf_tokenizer(list(TOWER_PROBE_TEXTS), padding=True, truncation=True, return_tensors="pt",
                           max_length=int(model.config.text_config.max_position_embeddings))
    ids = encoded["input_ids"]
    mask = encoded.get("attention_mask", torch.ones_like(ids))
    # The references come first: tracing leaves the model object altered.
    with torch.inference_mode():
        expected_images = ImageTower(model)(pixels) if size else None
        expected_texts = TextTower(model, feed)(ids, mask)
    if size:
        vision = _export_tower(_ImageFeatures(model), (pixels[:2],), ["pixel_values"], "image_embeds",
                               model_dir / VISION_ONNX_FILE,
                               lambda path: OnnxImageTower(path, threads=1)(pixels), expected_images)
    else:  # the tower resizes its position table to each image's grid, in Python, at run time
        vision = "not exported (a variable-resolution tower: each image's grid of patches is its own), run by torch"
    text = _export_tower(_TextFeatures(model), feed.graph_inputs(ids[:2], mask[:2]),
                         ["input_ids", "attention_mask"], "text_embeds", model_dir / TEXT_TOWER_ONNX_FILE,
                         lambda path: OnnxTextTower(path, threads=1, feed=feed)(ids, mask), expected_texts)
    return f"vision tower {vision}; text tower {text}"


def _export_tower(graph: torch.nn.Module, example: tuple[torch.Tensor, ...], inputs: list[str], output: str,
                  target: Path, served: Callable[[Path], torch.Tensor], expected: torch.Tensor) -> str:
    """One tower traced to `target`, dynamic in batch (and length for ids), and checked: what its
    engine serves from the file against torch's `expected`; no file where either fails."""
    axes = {name: {0: "batch"} if name == "pixel_values" else {0: "batch", 1: "sequence"} for name in inputs}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(graph, example, str(target), input_names=inputs, output_names=[output],
                              dynamic_axes={**axes, output: {0: "batch"}}, opset_version=17, dynamo=False)
        difference = float((served(target) - expected).abs().max())
    except Exception as err:  # any exporter or runtime failure: torch runs this tower
        target.unlink(missing_ok=True)
        return f"not exported ({type(err).__name__}: {str(err)[:200]}), run by torch"
    if difference > MAX_ABS_DIFFERENCE:
        target.unlink()
        return f"not used: its features differ from torch by {difference:.1e}, run by torch"
    return f"exported (max difference to torch {difference:.1e})"


def trace_to_onnx(graph: torch.nn.Module, path: Path, segments: bool = False) -> None:
    """The graph (a model wrapped to give one tensor), ids and attention mask (and token types
    with `segments`) to its output, dynamic in batch and length."""
    example = torch.ones((2, 8), dtype=torch.long)
    if not isinstance(graph, (_LastHiddenState, _Logits)):
        graph = _LastHiddenState(graph)
    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if segments else [])
    args = (example, torch.ones_like(example)) + ((torch.zeros_like(example),) if segments else ())
    output = "logits" if isinstance(graph, _Logits) else "last_hidden_state"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            graph, args, str(path), input_names=inputs, output_names=[output],
            dynamic_axes={**{name: {0: "batch", 1: "sequence"} for name in inputs},
                          output: {0: "batch"} if output == "logits" else {0: "batch", 1: "sequence"}},
            opset_version=17, dynamo=False)


def _optimize(raw: Path, target: Path, config) -> str:
    """ONNX Runtime's offline transformer fusions; the plain export where it knows no pattern."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    options = FusionOptions("bert")
    # Residual add + LayerNorm stay two operators (embedserve/handler/backends/onnx_runtime.py says why).
    options.enable_skip_layer_norm = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("onnxruntime").setLevel(logging.ERROR)
        optimized = optimizer.optimize_model(str(raw), model_type="bert", num_heads=heads, hidden_size=hidden,
                                             optimization_options=options)
    optimized.save_model_to_file(str(target))
    fused = {name: count for name, count in optimized.get_fused_operator_statistics().items() if count}
    return "fused: " + (", ".join(f"{count} {name}" for name, count in fused.items()) or "none")


def _probe_batch(vocab_size: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids of mixed lengths, padded: (batch, seq) ids and attention mask."""
    generator = torch.Generator().manual_seed(0)
    lengths = [length for length in (1, 5, 17, 64, 300) if length <= max_positions] or [1]
    ids = torch.randint(5, vocab_size, (len(lengths), max(lengths)), generator=generator)
    return ids, (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
