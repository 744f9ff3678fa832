"""vLLM's own engine metrics, carried from the workers to the API's ``GET /metrics``.

A worker on the vLLM backend runs vLLM's Prometheus stat logger in its process (the
``vllm:`` series a ``vllm serve`` exports: scheduler state, KV usage, token counters, latency
histograms, speculative decoding). Its heartbeat stores a snapshot of those series in Redis
(``coserve:engine-metrics:<worker_id>``, expiring if the worker stops beating), with the worker's model: the API
merges its deployment's live workers' snapshots (where the database cannot say which are live, those of its model
still in Redis) into one family per name, each sample labelled with its ``worker_id``. Where vLLM exports a name
itself, coserve's SQL-derived alias of that name (``collector.VLLM_ALIASES``) is left out, so each name appears once.
A worker on coserve's own engine publishes the same way the ``vllm:`` series its engine thread observes
(``OwnEngineSeries``: those the jobs' rows cannot give, which no alias names).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.metrics_core import METRIC_TYPES
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gpu_runtime.speculation.counts import SpecDecodeCounts

log = logging.getLogger(__name__)

KEY_PREFIX = "coserve:engine-metrics:"
ENGINE_PREFIX = "vllm:"
# the names the Prometheus text format can carry
SERIES_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# vLLM's bucket edges of inter_token_latency_seconds and request_time_per_output_token_seconds
# (vllm/v1/metrics/buckets.py)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)


class OwnEngineSeries:
    """The ``vllm:`` series a worker on coserve's own engine observes as vLLM's stat logger would, where the jobs'
    rows cannot give them (the API derives the rest from SQL: ``collector.VLLM_ALIASES``): vLLM's inter-token latency,
    one observation per engine step that gave a request tokens after its first, its speculative decoding counters
    (``spec_decode``, where the engine speculates), and its scheduler's state (the
    requests in the engine's batch, and those it holds that wait: a job's SQL state cannot say, as a worker leases up
    to COSERVE_MAX_INFLIGHT jobs). In the worker's own registry, which its heartbeat publishes as a vLLM worker's
    (``publish``)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # vLLM's names, help, labels (one engine: "0") and buckets
        labels, engine = ["model_name", "engine"], (model_name, "0")
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", labelnames=labels,
                                             buckets=INTER_TOKEN_LATENCY_BUCKETS, registry=self.registry
                                             ).labels(*engine)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             labelnames=labels, registry=self.registry).labels(*engine)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             labelnames=labels, registry=self.registry).labels(*engine)
        self._engine_labels = engine
        self._spec_counters: dict[str, Counter] = {}  # vLLM's spec_decode_* (an engine that speculates)
        self._spec_seen: dict[tuple[str, int | None], int] = {}  # each counter's total already counted

    def scheduler_state(self, queues: dict[str, int]) -> None:
        """The engine's queues (``Scheduler.queue_depths``) as vLLM's gauges: its decoding batch runs; the requests
        it holds for their prompt (not begun or part-way) and those it relegated wait."""
        self.running.set(queues.get("decode", 0))
        self.waiting.set(queues.get("prefill", 0) + queues.get("relegated", 0))


    def spec_decode(self, counts: SpecDecodeCounts) -> None:
        """The engine's speculative decoding totals as vLLM's counters (names, help, labels: its SpecDecodingProm),
        registered at the first call: an engine that speculates exports them, zero before its first draft, as
        vLLM's does where speculation is configured."""
        if not self._spec_counters:
            labels = ["model_name", "engine"]
            for name, doc in (("num_drafts", "Number of spec decoding drafts."),
                              ("num_draft_tokens", "Number of draft tokens."),
                              ("num_accepted_tokens", "Number of accepted tokens.")):
                self._spec_counters[name] = Counter(f"vllm:spec_decode_{name}", doc, labelnames=labels,
                                                    registry=self.registry)
                self._spec_counters[name].labels(*self._engine_labels)
            self._spec_counters["per_pos"] = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                                     "Accepted tokens per draft position.",
                                                     labelnames=[*labels, "position"], registry=self.registry)
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            self._count(self._spec_counters[name].labels(*self._engine_labels), (name, None), getattr(counts, name))
        for pos, total in enumerate(counts.num_accepted_tokens_per_pos):
            self._count(self._spec_counters["per_pos"].labels(*self._engine_labels, str(pos)), ("per_pos", pos),
                        total)

    def _count(self, counter, key: tuple[str, int | None], total: int) -> None:
        """Adds what ``total`` grew by since the last call (a counter only goes up)."""
        grown = total - self._spec_seen.get(key, 0)
        if grown > 0:
            counter.inc(grown)
            self._spec_seen[key] = total


def engine_metrics_key(worker_id: str) -> str:
    return KEY_PREFIX + worker_id


def snapshot(registry: CollectorRegistry = REGISTRY, prefix: str = ENGINE_PREFIX) -> list[dict]:
    """The registry's families whose name starts with ``prefix``, as JSON-ready dicts."""
    out = []
    for family in registry.collect():
        if not family.name.startswith(prefix):
            continue
        out.append({"name": family.name, "type": family.type, "doc": family.documentation,
                    "samples": [[s.name, s.labels, s.value] for s in family.samples]})
    return out


def publish(client, worker_id: str, ttl_s: float, registry: CollectorRegistry = REGISTRY, *,
            model_name: str) -> int:
    """Stores this process's engine series for the API, with the worker's model (``model_name``: its deployment's);
    returns how many families (0: none to send)."""
    families = snapshot(registry)
    if families:
        blob = {"model_name": model_name, "families": families}
        client.set(engine_metrics_key(worker_id), json.dumps(blob), ex=max(1, int(ttl_s)))
    return len(families)


def read_snapshot(blob: bytes) -> tuple[str | None, list[dict]]:
    """A stored snapshot's model and families (model None: one a worker stored before snapshots named it), those
    that can be exported alone: one a worker of another version (or a bug) stored with a missing or odd field failed
    every worker's scrape, the API's own series with them. Raises ValueError where the blob is no snapshot."""
    data = json.loads(blob)
    if not isinstance(data, (list, dict)):
        raise ValueError("not a snapshot of engine metrics")
    model, families = (None, data) if isinstance(data, list) else (data.get("model_name"), data.get("families"))
    if not isinstance(families, list) or not (model is None or isinstance(model, str)):
        raise ValueError("not a snapshot of engine metrics")
    readable = [fam for fam in families if exportable(fam)]
    if len(readable) < len(families):
        log.warning("%d of the %d engine metric families in a snapshot cannot be read; left out",
                    len(families) - len(readable), len(families))
    return model, readable


def exportable(family) -> bool:
    """Whether a family from a snapshot has every field ``snapshot`` writes, each of a type and a name the text
    format carries (its samples' names: the family's, with a suffix)."""
    if not isinstance(family, dict) or family.get("type") not in METRIC_TYPES:
        return False
    name, doc, samples = family.get("name"), family.get("doc"), family.get("samples")
    if not (isinstance(name, str) and SERIES_NAME.fullmatch(name) and isinstance(doc, str)
            and isinstance(samples, list)):
        return False
    return all(_exportable_sample(smp, name) for smp in samples)


def _exportable_sample(sample, family_name: str) -> bool:
    if not (isinstance(sample, list) and len(sample) == 3):
        return False
    name, labels, value = sample
    if not (isinstance(name, str) and name.startswith(family_name) and SERIES_NAME.fullmatch(name)):
        return False
    if not (isinstance(labels, dict) and all(isinstance(k, str) and LABEL_NAME.fullmatch(k) and isinstance(v, str)
                                             for k, v in labels.items())):
        return False
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # NaN and infinities: the format's too


def merge(snapshots: dict[str, list[dict]], left_out: frozenset[str] = frozenset()) -> list[Metric]:
    """One family per name over the workers' snapshots, each sample labelled with its worker; none named in
    ``left_out`` (the names the API exports itself: a name twice in a scrape is counted twice by a dashboard's sum)."""
    families: dict[str, Metric] = {}
    clashes = sorted({fam["name"] for fams in snapshots.values() for fam in fams} & left_out)
    if clashes:
        log.warning("workers export %s, which this API derives itself (its backend: not vllm); theirs are left out: "
                    "set COSERVE_BACKEND=vllm on the API where its workers run vLLM", ", ".join(clashes))
    for worker_id, fams in sorted(snapshots.items()):
        for fam in fams:
            if fam["name"] in left_out:
                continue
            family = families.get(fam["name"])
            if family is None:
                family = families[fam["name"]] = Metric(fam["name"], fam["doc"], fam["type"])
            elif family.type != fam["type"]:
                log.warning("engine metric %s is a %s on %s, a %s elsewhere; skipped there", fam["name"],
                            fam["type"], worker_id, family.type)
                continue
            for name, labels, value in fam["samples"]:
                family.add_sample(name, {**labels, "worker_id": worker_id}, value)
    return list(families.values())


class EngineMetricsCollector(Collector):
    """The live workers' engine series, read from Redis at scrape time."""

    def __init__(self, redis_url: str, worker_ids: list[str] | None, *, model_name: str,
                 left_out: frozenset[str] = frozenset()) -> None:
        """``worker_ids``: the deployment's live workers (None where the database cannot say: every snapshot of
        ``model_name``'s workers still in Redis, each expiring once its worker stops beating; another deployment's on
        the same Redis are its own). ``left_out``: the names the API exports itself (``merge``)."""
        self.redis_url, self.worker_ids, self.model_name = redis_url, worker_ids, model_name
        self.left_out = left_out
        self._families: list[Metric] | None = None

    def families(self) -> list[Metric]:
        if self._families is None:
            self._families = merge(self._read(), self.left_out)
        return self._families

    def _read(self) -> dict[str, list[dict]]:
        if self.worker_ids == []:
            return {}
        import redis

        try:
            client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)
            workers = self.worker_ids
            if workers is None:
                workers = sorted(k.decode()[len(KEY_PREFIX):] for k in client.scan_iter(KEY_PREFIX + "*"))
            raw = client.mget([engine_metrics_key(w) for w in workers]) if workers else []
        except redis.RedisError as exc:  # the SQL-derived series still answer
            log.warning("engine metrics unavailable: %s", exc)
            return {}
        out = {}
        for worker_id, blob in zip(workers, raw):
            if not blob:
                continue
            try:
                model, families = read_snapshot(blob)
            except ValueError:  # no JSON, or not a snapshot
                log.warning("unreadable engine metrics from %s", worker_id)
                continue
            # a snapshot that names no model is kept where the database named its worker the deployment's
            if model == self.model_name or (model is None and self.worker_ids is not None):
                out[worker_id] = families
        return out

    def collect(self) -> Iterator[Metric]:
        yield from self.families()
