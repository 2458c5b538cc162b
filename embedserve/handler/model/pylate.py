"""PyLate's ColBERT layout, read as sentence-transformers 6's MultiVectorEncoder reads it when it
loads such a folder (answerai-colbert-small-v1 publishes it): `modules.json` lists the Transformer
and its `pylate.models.Dense.Dense` projections only, the token-level MultiVectorMask and Normalize
being implied; `config_sentence_transformers.json` holds flat keys instead of the modules' configs:

    query_prefix, document_prefix      prepended to the text, before any saved prompt of that name
    query_length, do_query_expansion,  a query padded with the mask token to query_length (32 when
    attend_to_expansion_tokens         unset) unless do_query_expansion is false; attended or not
    document_length                    a document's length, over max_seq_length
    skiplist_words                     left out of a document's vectors (PyLate's default: punctuation)

PyLate's Dense is sentence-transformers' Dense on the token embeddings (same config and weights).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from embedserve.handler.model.description import HeadModule, ModelFilesError, MultiVector, QueryExpansion
from embedserve.handler.model.head import check_head_module

DENSE = "pylate.models.Dense.Dense"
# Keys only PyLate's (and Stanford ColBERT's) saves put at the top of config_sentence_transformers.json.
MARKERS = ("query_prefix", "document_prefix", "do_query_expansion", "attend_to_expansion_tokens",
           "attend_to_mask_tokens", "skiplist_words")
PREFIXES = {"query": "query_prefix", "document": "document_prefix"}


def is_pylate(modules: list[dict[str, Any]], st_config: dict[str, Any]) -> bool:
    return st_config.get("model_type") == "ColBERT" or any(key in st_config for key in MARKERS) \
        or any(module.get("type") == DENSE for module in modules)


def read_pylate(where: Path, kinds: list[str], denses: list[tuple[str, dict[str, Any]]], st_config: dict[str, Any],
                transformer: dict[str, Any]) -> tuple[MultiVector, tuple[HeadModule, ...]]:
    """`denses`: each Dense module's (folder, config), in order; `transformer`: sentence_bert_config.json."""
    if kinds[:1] != ["Transformer"] or len(kinds) < 2 or set(kinds[1:]) != {"Dense"}:
        raise ModelFilesError(f"{where}: a PyLate ColBERT folder with modules {kinds}; supported: the Transformer "
                              "and Dense modules")
    head = tuple(check_head_module(HeadModule("Dense", folder, config), f"modules.json module {position}",
                                   feature="token_embeddings") for position, (folder, config) in enumerate(denses, 1))
    query_length = st_config.get("query_length")
    expansion = None
    if st_config.get("do_query_expansion") is not False:
        attend = st_config.get("attend_to_expansion_tokens", st_config.get("attend_to_mask_tokens"))
        expansion = QueryExpansion("fixed", int(query_length or 32), bool(attend))
        query_length = None  # the expansion's length, as sentence-transformers moves it
    skiplist = st_config.get("skiplist_words")
    similarity = str(st_config.get("similarity_fn_name") or "").lower()
    model = MultiVector(
        query_length=query_length, document_length=st_config.get("document_length") or transformer.get(
            "document_length"), expansion=expansion,
        skiplist_words=tuple(string.punctuation if skiplist is None else skiplist), skiplist_tasks=("document",),
        similarity=similarity if similarity in ("maxsim", "meanmaxsim") else "maxsim",
        prefixes=tuple((kind, str(st_config[key] or "")) for kind, key in PREFIXES.items() if key in st_config))
    return model, (*head, HeadModule("Normalize", ""))


def prefixed_prompts(prompts: dict[str, str], prefixes: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The saved prompts with PyLate's prefixes ahead of them, as sentence-transformers composes them."""
    return {**prompts, **{kind: prefix + prompts.get(kind, "").removeprefix(prefix) for kind, prefix in prefixes}}
