"""A causal reranker's LogitScore as one Linear over the last token's state: equal to the
language model's own logit(true) - logit(false), from a tied or an untied head, and the true
token's logit alone where the model names no false token."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from embedserve.handler.model.description import LogitScore, ModelFilesError
from embedserve.handler.model.head import logit_score_head


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("score", [LogitScore(7, 3), LogitScore(11, None)])
def test_the_head_gives_the_language_model_s_logit_difference(tmp_path, tied, score):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=8, intermediate_size=32,
                                         tie_word_embeddings=tied)).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 50, (3, 9))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -1]  # (3, vocab)
        last = model.model(input_ids=ids).last_hidden_state[:, -1]  # (3, hidden)
        got = logit_score_head(tmp_path, score, torch.device("cpu"))(last)[:, 0]
    want = logits[:, score.true_token_id] - (logits[:, score.false_token_id] if score.false_token_id is not None else 0)
    assert torch.allclose(got, want, atol=1e-5)


def test_weights_without_a_head_are_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFilesError, match="no language model head"):
        logit_score_head(tmp_path, LogitScore(1, 2), torch.device("cpu"))
