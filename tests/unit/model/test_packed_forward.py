"""The packed forward pass (embedserve/handler/backends/packed.py) against the model's own padded forward and
embedserve/handler/model/pooling.py, on tiny random models of each supported family and on the real
all-MiniLM-L6-v2 against sentence-transformers."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, BertConfig, BertModel, RobertaConfig, RobertaModel

from embedserve.handler.backends.base import PassCost
from embedserve.handler.backends.packed import PackedBackend
from embedserve.handler.backends.padded import PaddedBackend
from embedserve.handler.model.description import POOLING_MODES
from embedserve.handler.model.packed_forward import (
    GROUPED_SDPA, VARLEN_FLASH, PackedTransformer, attention_kernel, length_groups, pack, packed_support, pool_packed,
)
from embedserve.handler.model.inputs import ModelInput, TokenRole
from embedserve.handler.model.pooling import pool

POOLED, PROMPT = TokenRole.POOLED, TokenRole.PROMPT
from tests.support.inputs import random_rows, varied_texts

SUPPORTED_FAMILIES = ("bert_dense", "xlmr", "mpnet")
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def models(families):
    return {family: AutoModel.from_pretrained(families[family]).eval() for family in families}


def usable_positions(model) -> int:
    """Tokens per input the position embeddings allow (RoBERTa-style models start at padding_idx + 1)."""
    offset = 0 if isinstance(model, BertModel) else model.embeddings.padding_idx + 1
    return model.config.max_position_embeddings - offset


def padded_forward(model, rows, unpooled=None):
    """The padded path as the encoder runs it: right padding, a pooling mask marking prompt tokens.
    -> (n, seq, hidden) states and (n, seq) pooling mask."""
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), model.config.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = POOLED
        if unpooled:
            mask[row, :min(unpooled[row], len(tokens))] = PROMPT
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask.clamp(max=1)).last_hidden_state
    return hidden, mask


def packed_forward(model, rows):
    packed = pack(rows)
    return PackedTransformer(model)(*packed), packed


def assert_rows_close(got, want):
    """Every vector within cosine MIN_COSINE; identical vectors (zeros, -inf) agree."""
    assert got.shape == want.shape
    same = (got == want).all(dim=-1)
    cosine = torch.where(same, 1.0, F.cosine_similarity(got, want, dim=-1))
    assert cosine.min() >= MIN_COSINE, f"min cosine {cosine.min():.6f} at {int(cosine.argmin())}"


def batches(model):
    longest = usable_positions(model)
    return {
        "mixed": [7, 1, 30, 12, longest, 3, 19, 2, 45],
        "one": [23],
        "one_long_many_short": [longest] + [4, 2, 6, 3, 5] * 8,
        "every_length": list(range(1, longest + 1)),
    }


@pytest.mark.parametrize("shape", ["mixed", "one", "one_long_many_short", "every_length"])
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_token_states_match_the_padded_forward(models, family, shape):
    model = models[family]
    rows = random_rows(model, batches(model)[shape], seed=len(shape))
    hidden, mask = padded_forward(model, rows)
    states, packed = packed_forward(model, rows)
    assert states.shape == (sum(map(len, rows)), model.config.hidden_size)
    assert_rows_close(states, hidden[mask.bool()])  # the padded states of real tokens, row after row
    assert_rows_close(pool_packed(states, packed.cu_seqlens, None, ("mean",)), pool(hidden, mask, ("mean",)))


@pytest.mark.parametrize("modes", [(mode,) for mode in POOLING_MODES] + [tuple(POOLING_MODES), ("max", "cls")])
def test_every_pooling_mode_matches_pool(models, modes):
    model = models["bert_dense"]
    rows = random_rows(model, [9, 1, 33, 4, 17, 2])
    hidden, mask = padded_forward(model, rows)
    states, packed = packed_forward(model, rows)
    got = pool_packed(states, packed.cu_seqlens, None, modes)
    assert got.dtype == torch.float32 and got.shape == (len(rows), model.config.hidden_size * len(modes))
    assert_rows_close(got, pool(hidden, mask, modes))


@pytest.mark.parametrize("mode", POOLING_MODES)
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_prompt_tokens_are_attended_to_but_not_pooled(models, family, mode):
    model = models[family]
    rows = random_rows(model, [9, 1, 33, 4, 17, 2, 6])
    unpooled = [3, 0, 5, 4, 1, 7, 2]  # a prompt as long as its input, and one longer: nothing is pooled
    hidden, mask = padded_forward(model, rows, unpooled)
    states, packed = packed_forward(model, rows)
    got = pool_packed(states, packed.cu_seqlens, unpooled, (mode,))
    assert_rows_close(got, pool(hidden, mask, (mode,)))
    if mode != "last_token":  # the last token is never part of the prompt
        assert not torch.allclose(got[0], pool_packed(states, packed.cu_seqlens, None, (mode,))[0])


def test_pooling_on_given_states_equals_pool_exactly():
    """pool_packed and pool on the same states, ragged prompts included, to float rounding."""
    torch.manual_seed(0)
    lengths, unpooled = [5, 1, 8, 3], [2, 1, 0, 4]
    hidden = torch.randn(len(lengths), max(lengths), 16)
    mask = torch.zeros(hidden.shape[:2], dtype=torch.long)
    for row, (length, prompt) in enumerate(zip(lengths, unpooled)):
        mask[row, :length] = POOLED
        mask[row, :min(prompt, length)] = PROMPT
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = pool_packed(hidden[mask.bool()], cu_seqlens, unpooled, POOLING_MODES)
    torch.testing.assert_close(got, pool(hidden, mask, POOLING_MODES), rtol=1e-6, atol=1e-6)


def test_late_chunk_spans_pool_alike_packed_and_padded(models):
    """Late chunking's spans (ModelInput.unpooled to pooled_end) of shared windows, beside a plain
    input: the packed backend packs each distinct window once and pools every span from it, equal to
    the padded backend, which runs each distinct row once too (mean, max, sqrt-len: span poolings)."""
    model = models["bert_dense"]
    window, other, plain = random_rows(model, [20, 12, 9])
    rows = [ModelInput(window, unpooled=1, pooled_end=6), ModelInput(window, unpooled=6, pooled_end=19),
            ModelInput(other, unpooled=3, pooled_end=7), ModelInput(plain), ModelInput(window, unpooled=1,
                                                                                      pooled_end=6)]
    modes = ("mean", "max", "mean_sqrt_len_tokens")
    packed = PackedBackend(PackedTransformer(model), modes, None)
    inputs = packed.prepare(rows)
    assert inputs.ids.numel() == 20 + 12 + 9 and packed.computed_tokens(inputs) == 41  # each window once
    padded = PaddedBackend(lambda ids, mask, segments: model(input_ids=ids, attention_mask=mask).last_hidden_state,
                           modes=modes, head=None, pad_id=model.config.pad_token_id, pad_multiple=1,
                           device=torch.device("cpu"), facts={})
    laid_out = padded.prepare(rows)
    assert laid_out.shared[0].numel() == 3 and padded.computed_tokens(laid_out) == 3 * 20
    assert_rows_close(packed.run(inputs), padded.run(laid_out))
    got = packed.run(inputs)
    assert torch.equal(got[0], got[4]) and not torch.allclose(got[0], got[1])
    # A row ending in the padding id is not a shorter row padded: the same ids, another length.
    ends_in_pad = ModelInput([3, 4, 0], unpooled=1, pooled_end=2)
    apart = PaddedBackend(None, modes=modes, head=None, pad_id=0, pad_multiple=1, device=torch.device("cpu"),
                          facts={}).prepare([ends_in_pad, ModelInput([3, 4], 1, 0, 0, 2)])
    assert apart.shared is None


def tiny_roberta():
    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=40, pad_token_id=1)
    return RobertaModel(config).eval()


@pytest.mark.parametrize("name", ["roberta", "xlmr"])
def test_roberta_positions_start_after_the_padding_id(models, name):
    """Positions restart at padding_idx + 1 for each input: the longest input reaches the last
    position embedding, and a padding id inside an input keeps position padding_idx, as the
    model's own create_position_ids_from_input_ids gives it."""
    model = tiny_roberta() if name == "roberta" else models["xlmr"]
    pad = model.config.pad_token_id
    assert model.embeddings.padding_idx == pad
    rows = random_rows(model, [usable_positions(model), 5, 11], seed=3)
    rows[1][2] = pad
    hidden, mask = padded_forward(model, rows)
    states, _ = packed_forward(model, rows)
    assert_rows_close(states, hidden[mask.bool()])


def test_positions_are_not_zero_based_in_roberta_models(models):
    """The offset matters: the same ids at positions 0.. would give other states."""
    model = models["xlmr"]
    rows = random_rows(model, [6])
    states, _ = packed_forward(model, rows)
    ids = torch.tensor(rows)
    with torch.inference_mode():
        zero_based = model(input_ids=ids, position_ids=torch.arange(6)[None]).last_hidden_state[0]
    assert not torch.allclose(states, zero_based, atol=1e-3)


@pytest.mark.parametrize("family", ["qwen3", "modernbert"])
def test_other_architectures_are_reported_unsupported(models, family):
    reason = packed_support(models[family])
    assert reason and type(models[family]).__name__ in reason
    with pytest.raises(ValueError, match="unsupported"):
        PackedTransformer(models[family])


@pytest.mark.parametrize("change, expected", [
    (dict(is_decoder=True), "decoder"),
    (dict(position_embedding_type="relative_key"), "relative_key"),
])
def test_unsupported_configurations_are_reported(change, expected):
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, **change)
    assert expected in packed_support(BertModel(config).eval())


def test_a_model_in_training_mode_is_unsupported(models):
    model = models["bert_dense"]
    try:
        assert "training" in packed_support(model.train())
    finally:
        model.eval()


def test_attention_kernel_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    capability = (9, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert attention_kernel(cpu, torch.float32, 32) == GROUPED_SDPA
    assert attention_kernel(cpu, torch.bfloat16, 32) == GROUPED_SDPA
    assert attention_kernel(cuda, torch.float16, 32) == VARLEN_FLASH
    assert attention_kernel(cuda, torch.bfloat16, 64) == VARLEN_FLASH
    assert attention_kernel(cuda, torch.float32, 32) == GROUPED_SDPA  # flash attention takes half precision
    assert attention_kernel(cuda, torch.float16, 32, position_bias=True) == GROUPED_SDPA  # MPNet
    assert attention_kernel(cuda, torch.float16, 20) == GROUPED_SDPA  # head size not a multiple of 8
    capability = (7, 5)
    assert attention_kernel(cuda, torch.float16, 32) == GROUPED_SDPA  # flash attention needs sm80+


def test_cpu_models_run_the_grouped_kernel(models):
    assert {PackedTransformer(models[family]).attention_kernel for family in SUPPORTED_FAMILIES} == {GROUPED_SDPA}


def test_length_groups_cover_every_token_once():
    lengths = [250, 12, 12, 3, 240, 12, 170, 1]
    packed = pack([[5] * n for n in lengths])
    groups = length_groups(packed.cu_seqlens)
    assert sum(group.count for group in groups) == len(lengths)
    covered = torch.cat([torch.arange(g.span.start, g.span.stop) if g.span else g.tokens for g in groups])
    assert sorted(covered.tolist()) == list(range(sum(lengths)))
    for group in groups:  # a group's shortest input is at least 0.7 x its longest
        shortest = (group.key_mask.sum(-1).min() if group.key_mask is not None else group.length)
        assert shortest >= 0.7 * group.length
    assert [(g.count, g.length) for g in groups] == [(2, 250), (1, 170), (3, 12), (1, 3), (1, 1)]


def test_consecutive_equal_inputs_need_no_copies():
    groups = length_groups(pack([[5] * 16] * 4).cu_seqlens)
    assert len(groups) == 1 and groups[0].span == slice(0, 64) and groups[0].key_mask is None


def test_pack():
    packed = pack([[7, 8, 9], [1], [4, 5]])
    assert packed.ids.tolist() == [7, 8, 9, 1, 4, 5] and packed.ids.dtype == torch.int64
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 6] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_len == 3
    with pytest.raises(ValueError):
        pack([[1], []])


def test_passes_are_planned_by_real_tokens_longest_first(models):
    passes = PackedBackend(PackedTransformer(models["bert_dense"]), ("mean",), None)
    cost = PassCost(max_batch_tokens=100, max_batch_size=4, pass_overhead_tokens=32, replay_overhead_tokens=32)
    lengths = [30, 150, 20, 60, 5, 5, 5, 5, 5, 40]
    plan = passes.plan(lengths, cost)
    assert sorted(i for p in plan for i in p) == list(range(len(lengths)))
    assert [[lengths[i] for i in p] for p in plan] == [[150], [60, 40], [30, 20, 5, 5], [5, 5, 5]]
    assert passes.plan([], cost) == []


def test_passes_run_pooling_and_head_as_the_padded_path(models):
    model = models["xlmr"]
    torch.manual_seed(0)
    head = torch.nn.Linear(model.config.hidden_size * 2, 8)  # after two pooling modes
    passes = PackedBackend(PackedTransformer(model), ("mean", "cls"), head)
    rows = random_rows(model, [3, 40, 9, 1])
    unpooled = [1, 4, 0, 0]
    inputs = passes.prepare([ModelInput(row, skip) for row, skip in zip(rows, unpooled)])
    assert passes.computed_tokens(inputs) == inputs.ids.numel() == 53
    hidden, mask = padded_forward(model, rows, unpooled)
    with torch.inference_mode():
        assert_rows_close(passes.run(inputs), head(pool(hidden, mask, ("mean", "cls"))))


def test_minilm_matches_sentence_transformers():
    """The real all-MiniLM-L6-v2 packed (its own BertModel), mean pooled and normalized, against
    sentence-transformers' encode."""
    from sentence_transformers import SentenceTransformer

    from embedserve.archive.default_model import fetch_default_model

    texts = varied_texts(count=64)
    st = SentenceTransformer(str(fetch_default_model()), device="cpu")
    expected = torch.from_numpy(st.encode(texts, normalize_embeddings=True, batch_size=32))
    features = st.preprocess(texts)  # truncated at the model's 256 tokens, as encode does
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"])]
    assert max(map(len, rows)) == 256 and min(map(len, rows)) <= 3
    states, packed = packed_forward(st[0].auto_model, rows)
    got = F.normalize(pool_packed(states, packed.cu_seqlens, None, ("mean",)), dim=-1)
    assert_rows_close(got, expected)
