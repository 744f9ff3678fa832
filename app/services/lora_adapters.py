"""LoRA adapters an admin loads while coserve runs (vLLM's runtime LoRA updating), and the names a request may give.

``COSERVE_LORA_MODULES`` fixes the adapters a deployment starts with; with ``COSERVE_RUNTIME_LORA`` an admin adds
more (``POST /v1/load_lora_adapter``) and removes them (``/v1/unload_lora_adapter``). SQL keeps them
(``lora_adapters``), so every API process and every worker sees the same set. A runtime adapter's jobs go to its
model's queue: any worker of the model serves them, loading the adapter on its first request. Unloaded, it stays in
``unloaded_lora_adapters``: its jobs still waiting (a request that named it a moment before, a job the sweeper gives
back) go to that queue too, where a worker fails them saying it was unloaded; once none is left (and a while has
passed, for a request that named it just before), the sweeper drops that row (``prune_unloaded``).

Each process keeps what it read for ``FRESH_S``; a name it does not know is read again before it is refused, so a
job may name an adapter the moment its load was answered, whichever API process takes the job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Select, and_, delete, exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.db.models import Job, JobStatus, LoraAdapter, SummarizationRun, UnloadedLoraAdapter
from app.db.session import read_then_write, session_scope
from app.services.transitions import as_utc, utcnow
from app.settings import Settings, adapter_name_refusal
from app.summarize.store import OPEN as OPEN_RUNS
from gpu_runtime.vllm.lora import adapter_rank, is_lora, runtime_rank_limit

log = logging.getLogger(__name__)

FRESH_S = 1.0  # how long a process trusts what it read of the table
# how long an unloaded adapter's row outlives its last waiting job: a request that named the adapter just before
# the unload may write its job (and route it) later, and an API process trusts its read for FRESH_S
UNLOADED_KEPT = timedelta(minutes=10)
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's weight files, one of which vLLM loads


class AdapterError(ValueError):
    """A load or unload refused; ``status`` is the HTTP status it answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Adapter:
    model: str  # the served model it adapts
    path: str


_read: dict[str, tuple[float, dict[str, Adapter]]] = {}  # database url -> (when read, name -> adapter)


def _table(session: Session) -> dict[str, Adapter]:
    return {row.name: Adapter(row.model, row.path) for row in session.scalars(select(LoraAdapter))}


def loaded(settings: Settings, *, fresh: bool = False) -> dict[str, Adapter]:
    """The adapters loaded at runtime, every model's (none while runtime loading is off)."""
    if not settings.runtime_lora:
        return {}
    url = settings.sqlalchemy_url
    seen = _read.get(url)
    if seen is not None and not fresh and time.monotonic() - seen[0] < FRESH_S:
        return seen[1]
    with session_scope(url) as s:
        adapters = _table(s)
    _read[url] = (time.monotonic(), adapters)
    return adapters


def runtime_adapters(settings: Settings, *, fresh: bool = False) -> dict[str, Adapter]:
    """The runtime adapters of the model this deployment serves, but those whose name the settings give the model
    or a configured adapter since they were loaded (served as that, and listed once)."""
    configured = {*settings.model_names, *settings.lora_modules}
    return {name: a for name, a in loaded(settings, fresh=fresh).items()
            if a.model == settings.model_name and name not in configured}


def served_models(settings: Settings) -> tuple[str, ...]:
    """The models a request may name: the model, its configured adapters, those loaded since (the jobs' models)."""
    return (*settings.served_models, *runtime_adapters(settings))


def listed_models(settings: Settings) -> tuple[str, ...]:
    """``/v1/models``: the model under each of its names, then its adapters."""
    return (*settings.model_names, *settings.lora_modules, *runtime_adapters(settings))


def _runtime_adapter(settings: Settings, name: str) -> Adapter | None:
    """The runtime adapter ``name``, read again where this process has not seen it (loaded a moment ago)."""
    return loaded(settings).get(name) or loaded(settings, fresh=True).get(name)


def is_served(settings: Settings, model: str) -> bool:
    """Whether a request may name ``model``: the model (or an alias of it) or one of its adapters."""
    if model in settings.served_models or model in settings.model_aliases:
        return True
    adapter = _runtime_adapter(settings, model)
    return adapter is not None and adapter.model == settings.model_name


def queue_model(settings: Settings, model: str) -> str:
    """The model whose queue takes a job for ``model``: a runtime adapter's model (every worker of it serves the
    adapter), loaded or unloaded since, else ``model`` (a configured adapter has a queue of its own)."""
    if model in settings.served_models:
        return model
    adapter = _runtime_adapter(settings, model)
    if adapter is not None:
        return adapter.model
    with session_scope(settings.sqlalchemy_url) as s:  # unloaded after the request named it
        return queue_models(s, {model})[model]


def queue_models(session: Session, models: set[str]) -> dict[str, str]:
    """``queue_model`` for the models of jobs read from SQL (the sweeper's): model -> the model whose queue takes
    its jobs. An unloaded adapter's go there too: a worker fails them, where no worker reads a queue of its name."""
    if not models:
        return {}
    unloaded = session.execute(select(UnloadedLoraAdapter.name, UnloadedLoraAdapter.model)
                               .where(UnloadedLoraAdapter.name.in_(models))).all()
    live = session.execute(select(LoraAdapter.name, LoraAdapter.model).where(LoraAdapter.name.in_(models))).all()
    bases = {**dict(unloaded), **dict(live)}  # a name loaded again since: its row now
    return {m: bases.get(m, m) for m in models}


def unloaded_adapters(model: str) -> Select[tuple[str]]:
    """The names of ``model``'s runtime adapters unloaded (a subquery: the work of theirs still to end)."""
    return select(UnloadedLoraAdapter.name).where(UnloadedLoraAdapter.model == model)


def prune_unloaded(session: Session, kept: timedelta = UNLOADED_KEPT) -> int:
    """Drops the rows of adapters unloaded over ``kept`` ago of which no job is left to end (none waiting or
    running, no summarization validating or running on it): nothing routes by them any more. Returns how many went."""
    name = UnloadedLoraAdapter.name
    open_job = exists().where(Job.model == name, Job.status.not_in([s.value for s in JobStatus if s.terminal]))
    # a run validating writes its first level's jobs at its first step: it has none yet that keep the row
    open_run = exists().where(SummarizationRun.model == name, SummarizationRun.status.in_(OPEN_RUNS))
    return session.execute(delete(UnloadedLoraAdapter).where(
        and_(UnloadedLoraAdapter.unloaded_at < utcnow() - kept, ~open_job, ~open_run))
        .execution_options(synchronize_session=False)).rowcount


def resolve(settings: Settings, name: str) -> bool:
    """Loads ``<COSERVE_LORA_RESOLVER_DIR>/<name>`` as the runtime adapter ``name`` where a request names an adapter
    not loaded yet (vLLM's filesystem LoRA resolver): True once loaded (by this call or a concurrent one), False
    where the directory has no such adapter; an AdapterError where it has one this server cannot serve, which
    names the directory as the setting (the request's sender sees it), not by the server's path (logged).

    As vLLM's resolver answers: a directory that is no LoRA adapter of this model is not found (404), one that is
    but cannot be loaded here (no weights, a rank too high, a config it cannot read) a bad request (400)."""
    root = settings.lora_resolver_dir
    if root is None or not settings.runtime_lora or adapter_name_refusal(name) is not None:
        return False
    if name.startswith(".") or "/" in name or "\\" in name:  # one directory below the root, never above it
        return False
    root_dir = Path(root).expanduser().absolute()
    try:
        return _resolve(settings, name, root_dir / name)
    except ValueError as exc:  # an AdapterError, or an adapter_config.json without a rank
        log.warning("LoRA adapter %r of COSERVE_LORA_RESOLVER_DIR not loaded: %s", name, exc)
        raise AdapterError(str(exc).replace(str(root_dir), "COSERVE_LORA_RESOLVER_DIR"),
                           status=exc.status if isinstance(exc, AdapterError) else 400) from None


def _resolve(settings: Settings, name: str, directory: Path) -> bool:
    """``resolve`` of the adapter directory ``directory``: its errors may show the server's paths."""
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter {name!r} in COSERVE_LORA_RESOLVER_DIR: its adapter_config.json cannot "
                           f"be read ({exc})") from None
    if not is_lora(config):
        raise AdapterError(f"{name!r} in COSERVE_LORA_RESOLVER_DIR is not a LoRA adapter (peft_type LORA)",
                           status=404)
    base = config.get("base_model_name_or_path")
    if base and not _adapts(settings, str(base)):
        raise AdapterError(f"LoRA adapter {name!r} in COSERVE_LORA_RESOLVER_DIR adapts {base!r}, not this server's "
                           f"model {settings.model_name!r}", status=404)
    load(settings, name, str(directory), if_absent=True)
    return True


def _adapts(settings: Settings, base: str) -> bool:
    """Whether an adapter's base model is the served one: one of its names, its path, or that path's (or a hub
    id's) last part, case aside (``HuggingFaceTB/SmolLM2-135M-Instruct`` for ``smollm2-135m-instruct``)."""
    names = {n.lower() for n in (*settings.model_names, settings.model, Path(settings.model).name)}
    return base.lower() in names or base.rstrip("/").rsplit("/", 1)[-1].lower() in names


def adapter_source(session: Session, name: str) -> tuple[str, float] | None:
    """Where a worker loads a runtime adapter from, and its version (when it was last loaded, a POSIX time);
    None when it is not loaded (unloaded after its job came)."""
    row = session.get(LoraAdapter, name)
    return (row.path, as_utc(row.loaded_at).timestamp()) if row is not None else None


def was_unloaded(session: Session, name: str) -> bool:
    """Whether ``name`` is a runtime adapter unloaded since (its row kept while its jobs end: ``prune_unloaded``)."""
    return session.get(UnloadedLoraAdapter, name) is not None


def versions(session: Session, model: str) -> dict[str, tuple[str, float]]:
    """Each runtime adapter of ``model`` loaded now: name -> its path and version, as ``adapter_source`` gives them
    (an engine removes the others it loaded: ``VLLMEngine.retire_loras``)."""
    rows = session.scalars(select(LoraAdapter).where(LoraAdapter.model == model))
    return {row.name: (row.path, as_utc(row.loaded_at).timestamp()) for row in rows}


def ranks(session: Session, model: str) -> dict[str, int]:
    """Each runtime adapter of ``model`` loaded now: name -> its rank (what a worker's engine must serve of it)."""
    return dict(session.execute(select(LoraAdapter.name, LoraAdapter.rank).where(LoraAdapter.model == model)).all())


def unserved(said: Mapping[str, Any] | None, adapters: Mapping[str, int]) -> dict[str, str]:
    """The runtime adapters (name -> rank, ``ranks``) that a worker whose engine serves ``said``
    (``heartbeat_limits``) cannot serve, and why: loaded before it started (a load is held to the live workers
    only), their jobs fail there. None of them where it says nothing."""
    if said is None:
        return {}
    return {name: why for name, rank in sorted(adapters.items()) if (why := unserved_why(said, rank)) is not None}


def serves(state: Mapping[str, Any], name: str, rank: int) -> bool:
    """Whether a worker of the model, by its heartbeat's ``state``, serves the runtime adapter ``name`` of ``rank``:
    it does not name it among those it cannot (``lora_unserved``), nor say limits that hold it out."""
    said = heartbeat_limits(state)
    return name not in (state.get("lora_unserved") or {}) and (said is None or unserved_why(said, rank) is None)


def check_directory(settings: Settings, name: str, path: str) -> tuple[str, int]:
    """The adapter directory, absolute, and its rank; an AdapterError saying what to fix where it cannot serve."""
    try:
        directory = Path(path).expanduser()
        if not directory.is_absolute():
            raise AdapterError(f"lora_path {path!r}: give an absolute path (the workers load it from their own "
                               "working directory otherwise)")
        if not directory.is_dir():
            raise AdapterError(f"lora_path {path!r} is not a directory this server can read")
        rank = adapter_rank(name, directory)
        if not any((directory / w).is_file() for w in WEIGHTS):
            raise AdapterError(f"LoRA adapter {name!r}: no {' or '.join(WEIGHTS)} in {path}")
    except (OSError, RuntimeError) as exc:  # a name too long, a file it may not read, an unknown ~user
        raise AdapterError(f"lora_path {path!r} cannot be read here: {exc}") from None
    limit, source = runtime_rank(settings)
    if rank > limit:
        raise AdapterError(f"LoRA adapter {name!r} has rank {rank}; this server serves runtime adapters up to rank "
                           f"{limit} ({source}, set alike on the API and the workers)")
    return str(directory.resolve()), rank


def worker_limits(settings: Settings) -> dict[str, dict[str, Any]]:
    """What each live worker of the model serves of runtime adapters, as its heartbeat says (``heartbeat_limits``),
    by worker id: its own engine arguments may set it apart from what this API's settings say (a split deployment).
    A worker whose heartbeat says nothing of it is left out: nothing known holds a load."""
    from app.services.workers import live_workers  # it imports routing, which imports this module

    with session_scope(settings.sqlalchemy_url) as s:
        return {w.id: limits for w in live_workers(s, settings)
                if settings.model_name in w.served and (limits := heartbeat_limits(w.state or {})) is not None}


def heartbeat_limits(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a worker's heartbeat says its engine serves of runtime adapters: its ``lora``
    (``gpu_runtime.vllm.lora.lora_limits``); an older worker's, which publishes none, from its ``runtime_lora`` (its
    COSERVE_RUNTIME_LORA): off, its engine refuses every runtime adapter's job (``LoraRegistry.refusal``), on, no
    limit is known. None where it says nothing of them."""
    if isinstance(limits := state.get("lora"), dict):
        return limits
    return {"runtime": False} if state.get("runtime_lora") is False else None


def _off_why(said: Mapping[str, Any]) -> str:
    """Why a worker that says it loads no runtime adapters (``heartbeat_limits``) loads none."""
    if "max_lora_rank" in said and not isinstance(said["max_lora_rank"], int):
        return "its engine serves no LoRA (vLLM's enable_lora off, or the own engine)"
    return "COSERVE_RUNTIME_LORA is off there"


def unserved_why(said: Mapping[str, Any], rank: int) -> str | None:
    """Why a worker whose engine serves ``said`` of runtime adapters (``heartbeat_limits``) cannot serve one of
    ``rank``; None where it can (or nothing it says holds it)."""
    if not said.get("runtime"):
        return f"it loads no runtime adapters ({_off_why(said)})"
    top = said.get("max_lora_rank")
    if isinstance(top, int) and top < rank:
        return f"its rank {rank} is above the max_lora_rank {top} of its vLLM engine"
    return None


def lora_off_refusal(limits: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why no runtime adapter may be loaded where a worker of the model loads none (``worker_limits``): every job of
    the adapter that reaches it would fail there. None where each that says loads them."""
    off = {worker: _off_why(said) for worker, said in sorted(limits.items()) if not said.get("runtime")}
    if not off:
        return None
    workers = "; ".join(f"worker {w!r} of the model loads none ({why})" for w, why in off.items())
    return (f"LoRA adapters cannot be loaded at runtime: {workers}, so their jobs would fail there; start the "
            "model's workers on the vLLM backend with LoRA on and COSERVE_RUNTIME_LORA=1")


def worker_rank_refusal(limits: Mapping[str, Mapping[str, Any]], name: str, rank: int) -> str | None:
    """Why runtime adapter ``name`` of ``rank`` may not be loaded where a worker of the model serves a smaller rank
    (``worker_limits``: its engine's max_lora_rank, which vLLM holds each adapter it loads to). None where each that
    says serves it."""
    low = {worker: said["max_lora_rank"] for worker, said in sorted(limits.items())
           if isinstance(said.get("max_lora_rank"), int) and said["max_lora_rank"] < rank}
    if not low:
        return None
    workers = ", ".join(f"worker {w!r} of the model serves runtime adapters up to rank {r}" for w, r in low.items())
    return (f"LoRA adapter {name!r} has rank {rank}; {workers} (max_lora_rank of its vLLM engine): load an adapter "
            "of a smaller rank, or raise the workers' max_lora_rank (COSERVE_MAX_LORA_RANK, or their vLLM engine "
            "arguments)")


def runtime_rank(settings: Settings) -> tuple[int, str]:
    """The largest rank of a runtime adapter the workers' vLLM engines serve (``runtime_rank_limit``: their
    max_lora_rank, as the engine arguments are built), and the setting that makes it so."""
    from gpu_runtime.vllm.cli_args import operator_engine_args  # vLLM itself only where flags are set

    overrides = operator_engine_args(settings.vllm_engine_args, settings.vllm_args)
    source = ("max_lora_rank of the vLLM engine arguments (COSERVE_VLLM_ENGINE_ARGS, COSERVE_VLLM_ARGS)"
              if "max_lora_rank" in overrides else "COSERVE_MAX_LORA_RANK")
    return runtime_rank_limit(settings.max_lora_rank, overrides), source


def load(settings: Settings, name: str, path: str, *, load_inplace: bool = False, if_absent: bool = False) -> None:
    """Adds (or, ``load_inplace``, replaces) the runtime adapter ``name`` of the served model; ``if_absent``: one
    already loaded under that name is kept as it is."""
    _enabled(settings)
    if not name or not path:
        raise AdapterError("give both lora_name and lora_path")
    if (refused := adapter_name_refusal(name)) is not None:
        raise AdapterError(f"lora_{refused}")
    if name in settings.served_models or name in settings.model_aliases:
        what = "a name of the model" if name in settings.model_names else "an adapter of COSERVE_LORA_MODULES"
        raise AdapterError(f"lora_name {name!r} is {what}; choose another name")
    workers = worker_limits(settings)  # their own engine arguments may hold less than this API's settings
    if (refused := lora_off_refusal(workers)) is not None:
        raise AdapterError(refused)
    directory, rank = check_directory(settings, name, path)
    if (refused := worker_rank_refusal(workers, name, rank)) is not None:
        raise AdapterError(refused)
    # the read of the name and its write: one writer on SQLite; on PostgreSQL a load of the same new name may
    # commit in between (no row to lock yet), and then this one is judged again with that row there
    try:
        _load_row(settings, name, directory, rank, load_inplace, if_absent)
    except IntegrityError:
        _load_row(settings, name, directory, rank, load_inplace, if_absent)
    _read.pop(settings.sqlalchemy_url, None)


def _load_row(settings: Settings, name: str, directory: str, rank: int, load_inplace: bool, if_absent: bool) -> None:
    with read_then_write(settings.sqlalchemy_url) as session:
        row = session.get(LoraAdapter, name, with_for_update=True)
        if row is not None and if_absent and row.model == settings.model_name:
            return
        if row is not None and row.model != settings.model_name:  # neither unload nor load_inplace here reaches it
            raise AdapterError(f"LoRA adapter {name!r} adapts model {row.model!r}, not this server's; choose another "
                               "name")
        if row is not None and not load_inplace:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded; unload it first, or set load_inplace to "
                               "replace it")
        if row is None:
            session.add(LoraAdapter(name=name, model=settings.model_name, path=directory, rank=rank))
        else:  # the workers load it anew for the jobs that begin from now on
            row.path, row.rank, row.loaded_at = directory, rank, utcnow()


def unload(settings: Settings, name: str) -> None:
    """Removes the runtime adapter ``name``; its jobs still waiting then fail with a clear error."""
    _enabled(settings)
    if not name:
        raise AdapterError("give lora_name")
    # a name configured since it was loaded: its runtime row goes all the same (the configured adapter stays)
    with read_then_write(settings.sqlalchemy_url) as session:
        removed = session.execute(delete(LoraAdapter).where(LoraAdapter.name == name,
                                                            LoraAdapter.model == settings.model_name)).rowcount
        if removed and name not in settings.served_models:  # its jobs still waiting keep their model's queue
            session.merge(UnloadedLoraAdapter(name=name, model=settings.model_name, unloaded_at=utcnow()))
    _read.pop(settings.sqlalchemy_url, None)
    if not removed and name in settings.lora_modules:
        raise AdapterError(f"LoRA adapter {name!r} is configured by COSERVE_LORA_MODULES; remove it there")
    if not removed:
        raise AdapterError(f"LoRA adapter {name!r} is not loaded", status=404)


def _enabled(settings: Settings) -> None:
    if not settings.runtime_lora:
        raise AdapterError("loading LoRA adapters at runtime is off: start the API and workers with "
                           "COSERVE_RUNTIME_LORA=1", status=404)
