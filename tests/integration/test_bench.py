"""The benchmark's parts: corpora of exact lengths, and the load generator against the real server."""

import statistics

import pytest

from embedserve.archive.corpus import fixed_corpus, load_tokenizer, mixed_corpus
from bench.load import run_load


def test_fixed_corpus_has_exact_lengths(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir / "tokenizer.json")
    texts = fixed_corpus(tiny_model_dir / "tokenizer.json", 50, length=20)
    assert {len(tokenizer.encode(t).ids) for t in texts} == {20}
    assert texts == fixed_corpus(tiny_model_dir / "tokenizer.json", 50, length=20)  # deterministic


def test_mixed_corpus_is_long_tailed(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir / "tokenizer.json")
    lengths = [len(tokenizer.encode(t).ids) for t in mixed_corpus(tiny_model_dir / "tokenizer.json", 400)]
    assert min(lengths) >= 4 and max(lengths) <= 256
    assert 30 <= statistics.median(lengths) <= 50
    assert max(lengths) > 4 * statistics.median(lengths)


def test_load_generator_refuses_other_hosts():
    with pytest.raises(ValueError, match="loopback"):
        run_load("http://example.com/x", {}, ["a"], [1], concurrency=1, texts_per_request=1, seconds=0.1)


@pytest.mark.integration
def test_load_generator_against_the_server(server, tiny_model_dir):
    texts = fixed_corpus(tiny_model_dir / "tokenizer.json", 64, length=12)
    result = run_load(f"{server.url('inference')}/predictions/tiny", server.auth(), texts, [12] * 64,
                      concurrency=4, texts_per_request=2, seconds=1.0, warmup_seconds=0.2)
    summary = result.summary()
    assert result.errors == {} and result.requests >= 4
    assert result.texts == 2 * result.requests and result.tokens == 12 * result.texts
    assert summary["texts_per_s"] > 0 and 0 < summary["p50_ms"] <= summary["p99_ms"]


@pytest.mark.integration
def test_request_path_reads_the_cpu_of_the_model_s_own_workers(server, tiny_model_dir):
    """bench.request_path's CPU a request: the kernel's counters of the model's worker processes
    (from the management API) and of the frontend, which grow with the requests served."""
    import psutil

    from bench.request_path import worker_pids
    from bench.serving import server_cpu_seconds

    pids = worker_pids(server, "tiny")
    assert len(pids) == 1 and psutil.Process(pids[0]).ppid() == server.pid()
    assert set(worker_pids(server, "tinypacked")).isdisjoint(pids)
    before = server_cpu_seconds(server, pids)
    texts = fixed_corpus(tiny_model_dir / "tokenizer.json", 64, length=12)
    result = run_load(f"{server.url('inference')}/predictions/tiny", server.auth(), texts, [12] * 64,
                      concurrency=4, texts_per_request=1, seconds=1.0, warmup_seconds=0.0)
    assert result.errors == {}
    frontend, workers = (end - start for end, start in zip(server_cpu_seconds(server, pids), before))
    assert workers > 0 and frontend > 0
    # The model's own workers are a part of all the server's.
    assert server_cpu_seconds(server, pids)[1] <= server_cpu_seconds(server)[1]


@pytest.mark.integration
def test_load_generator_builds_each_request_s_body(server, tiny_model_dir):
    """The rerank benchmark's bodies: one per request, from the request's texts."""
    texts = [f"text {i}" for i in range(8)]
    seen = []
    result = run_load(f"{server.url('inference')}/predictions/tiny/1.0/embed", server.auth(), texts, [2] * 8,
                      concurrency=2, texts_per_request=4, seconds=0.5, warmup_seconds=0.1,
                      body=lambda batch: seen.append(tuple(batch)) or {"inputs": batch})
    assert result.errors == {} and set(seen) == {tuple(texts[:4]), tuple(texts[4:])}


def test_rerank_bench_pairs_hold_queries_of_8_to_32_tokens(tiny_model_dir):
    from bench.rerank import DOCUMENTS_PER_REQUEST, pairs_corpus

    tokenizer = load_tokenizer(tiny_model_dir / "tokenizer.json")
    queries, documents = pairs_corpus(tiny_model_dir / "tokenizer.json")
    assert queries and all(8 <= len(tokenizer.encode(q).ids) <= 32 for q in queries)
    assert {len(docs) for docs in documents} == {DOCUMENTS_PER_REQUEST}


def test_planner_bench_compares_least_cost_with_filled_passes(tiny_model_dir):
    from bench.inprocess import bench_planner
    from tests.support.engines import make_engine

    engine = make_engine(tiny_model_dir, max_batch_tokens=512, pass_overhead_tokens=16)
    texts = [" ".join(["word"] * n) for n in (2, 40, 3, 7, 50, 12, 5, 30) * 8]
    result = bench_planner(engine, texts, batch=16)
    least, filled = result["least_cost"], result["fill_budget"]
    assert result["pass_overhead_tokens"] == engine.encoder.pass_overhead_tokens == 16  # restored
    assert least["padding_efficiency"] > filled["padding_efficiency"]
    assert least["forward_passes"] > filled["forward_passes"] >= 4  # 64 texts, 16 per batch
    assert least["texts_per_s"] > 0 and filled["texts_per_s"] > 0
