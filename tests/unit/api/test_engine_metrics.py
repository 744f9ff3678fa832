"""Merging the workers' vLLM engine series into one family per name (pure logic)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.observability.engine_metrics import merge, snapshot


def _worker_registry(running: float, tokens: float) -> CollectorRegistry:
    reg = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", ["model_name"], registry=reg).labels("m").set(running)
    Counter("vllm:generation_tokens", "tokens", ["model_name"], registry=reg).labels("m").inc(tokens)
    Gauge("other_series", "not the engine's", registry=reg).set(1)
    return reg


def test_each_name_once_with_every_workers_samples_labelled():
    snaps = {"w1": snapshot(_worker_registry(2, 10)), "w2": snapshot(_worker_registry(3, 5))}
    assert {f["name"] for f in snaps["w1"]} == {"vllm:num_requests_running", "vllm:generation_tokens"}
    reg = CollectorRegistry()

    class _C:
        def collect(self):
            return merge(snaps)
    reg.register(_C())
    text = generate_latest(reg).decode()
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    running = {s.labels["worker_id"]: s.value for s in fams["vllm:num_requests_running"].samples}
    assert running == {"w1": 2.0, "w2": 3.0}
    tokens = {s.labels["worker_id"]: s.value for s in fams["vllm:generation_tokens"].samples
              if s.name.endswith("_total")}
    assert tokens == {"w1": 10.0, "w2": 5.0}


def test_a_type_clash_skips_that_workers_family():
    a = [{"name": "vllm:x", "type": "gauge", "doc": "x", "samples": [["vllm:x", {}, 1.0]]}]
    b = [{"name": "vllm:x", "type": "counter", "doc": "x", "samples": [["vllm:x_total", {}, 9.0]]}]
    (family,) = merge({"w1": a, "w2": b})
    assert family.type == "gauge" and [s.labels["worker_id"] for s in family.samples] == ["w1"]



def test_without_the_database_a_scrape_reads_its_own_models_workers_alone(redis_url):
    """While the database cannot say which workers are live, the collector reads every snapshot still in Redis: it
    exported another deployment's workers under this one's scrape. Each snapshot names its worker's model, and a
    scrape keeps its own model's."""
    import redis

    from app.observability.engine_metrics import EngineMetricsCollector, publish

    client = redis.Redis.from_url(redis_url)
    for worker_id, model in (("tiny-w", "tiny"), ("other-w", "other")):
        assert publish(client, worker_id, 60, _worker_registry(1, 1), model_name=model) == 2
    for workers in (None, ["tiny-w"]):  # the database down; up, its live workers
        collector = EngineMetricsCollector(redis_url, workers, model_name="tiny")
        seen = {s.labels["worker_id"] for family in collector.collect() for s in family.samples}
        assert seen == {"tiny-w"}, workers
