"""The one place the domain objects are built and wired: `build_services(settings)`.

Each object gets what it depends on when it is built, in dependency order, and
nothing is assigned to it afterwards:

    config      the settings file (localrt.config)
    events      the event bus of GET /v1/events
    downloads   download tasks, with the config's outbound options
    engines     the engine catalog, the listing and loading, one adapter per engine made
                with its settings (engines.json's EngineState is shared with installs;
                probe results are engines.probes)
    installs    engine installs, uninstalls and defaults, which download with `downloads`
    registry    the downloaded models' definitions (localrt.models.registry.Registry)
    scheduler   what runs: loads through `engines` with the options `StartOptions`
                resolves, each file first in a child (its `Vetting`, which keeps
                <engines>/vetted.json), reads the `registry`, and refuses to delete a
                running model or uninstall an engine in use
    pulls       pulls from the hub, which download with `downloads` and add to the
                registry once the scheduler's child loaded the files
    imports     imports of local files and folders, which add to the registry the same way
    metrics     what GET /metrics says: reads the scheduler's status, the downloads'
                totals and the admissions' counts at scrape time; the app counts
                requests in it
    remotes     remote models: their upstreams' health, and forwarding their chats
    requests    the one path of chats, completions, embeddings and reranks: the model's
                record, remote (through `remotes`) or local (a lease from the `scheduler`),
                timed in `metrics`, and the one queue (maxQueuedRequests) their
                requests wait in past their kind's limit; dialects start models and
                set keep-alives here
    chats       chat completions on the scheduler's models, each counted in `metrics`;
                their images read under the settings and the config's outbound options
    completions text completions (the legacy API) on the same models
    embeddings  embeddings, from models the scheduler runs in embedding mode
    reranks     documents scored against a query, by rerankers the scheduler runs
    responses   the Responses API's stored responses (localrt.dialects.responses.Store)
    ollama_names  Ollama's model names over the registry (localrt.dialects.ollama_models)
    utility     llama-server's utility routes (tokenize, detokenize, apply-template, props,
                slots) on the scheduler's running models, a chat's prompt rendered by `chats`
    admissions  each long-lived kind's Admission by name (localrt.admission.LIMITS): the
                chats', completions', embeddings', reranks' (which share the requests'
                queue) and event bus's own, and Ollama's pulls'

Handlers (localrt.api) get the `Services` and call these objects directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from localrt import security
from localrt.admission import LIMITS, Admission, Queue
from localrt.inference.chat import Chats
from localrt.inference.completions import Completions
from localrt.config import Config
from localrt.downloads.tasks import Downloads
from localrt.inference.embeddings import Embeddings
from localrt.inference.rerank import Reranks
from localrt.inference.media import Images, Policy
from localrt.engines.catalog import Engines
from localrt.events import EventBus
from localrt.engines.installs import EngineState, Installs
from localrt.engines.vetting import Vetting
from localrt.metrics import Metrics
from localrt.models.imports import Imports
from localrt.models.options import StartOptions
from localrt.models.pulls import Pulls
from localrt.models.registry import Registry
from localrt.remote.remotes import Remotes
from localrt.inference.requests import RequestPath
from localrt.dialects.ollama_models import Names
from localrt.dialects.responses import Store
from localrt.inference.scheduler import Scheduler
from localrt.inference.utility import Utility
from localrt.schemas import Validators
from localrt.settings import Settings

# Each open GET /v1/events stream holds a server thread (see localrt.server.THREADS).
MAX_EVENT_LISTENERS = LIMITS["events"]


@dataclass
class Services:
    """The domain objects handlers use. One set per app."""

    settings: Settings
    validators: Validators
    config: Config
    events: EventBus
    downloads: Downloads
    engines: Engines
    installs: Installs
    registry: Registry
    pulls: Pulls
    imports: Imports
    scheduler: Scheduler
    metrics: Metrics
    remotes: Remotes
    requests: RequestPath
    chats: Chats
    completions: Completions
    embeddings: Embeddings
    reranks: Reranks
    responses: Store
    ollama_names: Names
    utility: Utility
    admissions: dict[str, Admission]
    shutdown: Callable[[], None] | None = None

    def close(self) -> None:
        """End event streams, stop download tasks (their part files stay), unload models."""
        self.events.close()
        self.downloads.close()
        self.remotes.close()
        self.scheduler.close()

    def secrets(self) -> list[str]:
        """What never leaves in a reply or a log line: the settings' secrets (hub token,
        proxy password, API keys) and the remote models' upstream keys."""
        return [*security.secrets_of(self.settings.snapshot()), *self.remotes.secrets()]


def build_services(settings: Settings, *, shutdown: Callable[[], None] | None = None,
                   hardware=None, run_probe=None,
                   limits: dict[str, int] | None = None) -> Services:
    """Every domain object for these settings. `shutdown` stops the server (None when
    it cannot stop itself); `hardware` replaces detection and `run_probe(path, hw)` the
    gguf-cpp build check; `limits` replaces some of localrt.admission.LIMITS, for a
    server run with threads_for(them, maxQueuedRequests) threads (tests pass them in)."""
    unknown = set(limits or {}) - set(LIMITS)
    if unknown:
        raise ValueError(f"no such kind of request: {', '.join(sorted(unknown))}")
    limits = {**LIMITS, **(limits or {})}
    validators = Validators()
    config = Config(settings)
    events = EventBus(limits["events"])
    downloads = Downloads(config.get, events, lambda: settings["downloadConnections"])
    state = EngineState(settings.data_dir / "engines")
    # `settings`: what the engines' adapters are made with (the catalog's rows name theirs).
    engines = Engines(settings.data_dir / "engines", state, hardware=hardware,
                      run_probe=run_probe, rpc_trusted=lambda: settings["rpcTrustedHosts"],
                      settings={"prompt_cache_bytes": settings["promptCacheMiB"] << 20})
    installs = Installs(engines, state, downloads, config.get,
                        lambda: settings["engineIndexUrl"])
    registry = Registry(settings.data_dir / "models", validators)
    options = StartOptions(engines, lanes=settings["computeLanes"])
    scheduler = Scheduler(registry, engines, options,
                          max_models=settings["maxRunningModels"],
                          keep_alive=settings["keepAlive"] * 60,
                          lanes=settings["computeLanes"],
                          vetting=Vetting(settings.data_dir / "engines"),
                          gpu_overhead=settings["gpuOverheadMiB"] << 20)
    # Both have a child load a model's files before they register it.
    pulls = Pulls(settings, config, downloads, registry, vet=scheduler.vet_new)
    imports = Imports(registry, vet=scheduler.vet_new)
    # Each kind's counts are read at scrape time, from the admissions built below.
    metrics = Metrics(running=scheduler.status, downloads=downloads.stats,
                      admissions=lambda: {kind: (a.in_progress, a.queued)
                                          for kind, a in admissions.items()})
    remotes = Remotes(registry, engines, config.get, lambda: settings["upstreamTimeout"],
                      lambda: security.secrets_of(settings.snapshot()),
                      lambda: (settings["apiServerHost"], settings["apiServerPort"]))
    requests = RequestPath(registry, engines, scheduler, remotes, metrics,
                           Queue(settings["maxQueuedRequests"]))
    chats = Chats(requests, limits["chat"],
                  Images(config.get, lambda: Policy.of(settings)))
    completions = Completions(requests, limits["completion"])
    embeddings = Embeddings(requests, limits["embedding"])
    reranks = Reranks(requests, limits["rerank"])
    responses = Store()
    ollama_names = Names(registry, lambda: settings["modelHubOrg"])
    utility = Utility(requests, chats)
    # If you add a kind to localrt.admission.LIMITS, add its admission here.
    admissions = {"chat": chats.admission, "completion": completions.admission,
                  "embedding": embeddings.admission, "rerank": reranks.admission,
                  "events": events.admission,
                  "pull": Admission("pull", limits["pull"])}
    return Services(settings=settings, validators=validators, config=config, events=events,
                    downloads=downloads, engines=engines, installs=installs,
                    registry=registry, pulls=pulls, imports=imports, scheduler=scheduler,
                    metrics=metrics, remotes=remotes, requests=requests, chats=chats,
                    completions=completions,
                    embeddings=embeddings, reranks=reranks, responses=responses,
                    ollama_names=ollama_names, utility=utility,
                    admissions=admissions,
                    shutdown=shutdown)
